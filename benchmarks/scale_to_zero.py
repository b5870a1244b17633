"""A request to a model at zero replicas on the embedded runtime, as a user sees it: SmolLM2 (4
stage functions labelled to scale to zero after 3 s, entry kept, nothing cached by the
KeysManager), one request of 8 new tokens once every stage is at zero, against the same request on
the warm model; with cold replicas forked from the runtime zygote (QUART_WARM_RUNTIME, the default)
and started as new processes. Shards on this machine's disk (the page cache left as it is).

    python -m benchmarks scale_to_zero [--reps 3]
    QUART_COMPILE=false python -m benchmarks scale_to_zero     eager steps, scale_to_zero_eager.json
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from benchmarks.report import SERVING, conditions, scratch, table, write
from contracts.config import Settings, load_settings
from contracts.http_client import GatewayClient
from contracts.paths import REPO_ROOT
from contracts.stack import scale_to_zero_stack
from runtime import __main__ as control
from runtime.ports import free_port
from state.store import RedisStore

MEASURES = SERVING  # the code measured (benchmarks/freshness.py)

MODEL, IDLE, STAGES = "smollm2", "3s", 4
BODY = {"prompt": "The capital of France is", "max_new_tokens": 8}


def at_zero(client: GatewayClient, store: RedisStore) -> bool:
    """Every stage function at zero and none of their replicas left: a draining stage replica
    still takes what reaches it before it exits (`engine/replica.py stop`), and a request it
    served would not be one from zero."""
    stages = [f for f in client.functions() if f["name"].startswith(f"{MODEL}-s")]
    return (bool(stages) and all(f["replicas"] == 0 and f["availableReplicas"] == 0 for f in stages)
            and not any(store.live_replicas(MODEL, stage) for stage in range(STAGES)))


def timed(client: GatewayClient) -> tuple[float, dict]:
    started = time.monotonic()
    reply = client.invoke(MODEL, BODY)
    if reply.status != 200:
        raise RuntimeError(f"{reply.status}: {reply.body[:200]!r}")
    return time.monotonic() - started, reply.json()


def one_runtime(base: Settings, warm_runtime: bool, reps: int) -> dict:
    with scratch("quart-zero-") as home:
        settings = base.replace(home=str(home), models=str(base.models_dir), gateway_port=free_port(),
                                redis_port=free_port(), keysmanager_port=free_port(), cache_stages="none",
                                warm_runtime=warm_runtime, request_timeout_s=120.0,
                                stack_file=str(scale_to_zero_stack(REPO_ROOT / "stack.yml", home / "stack.yml", MODEL, IDLE)))
        try:
            if control.up(settings, timeout=600) != 0:
                raise RuntimeError("the runtime did not come up")
            client, store = GatewayClient.for_settings(settings), RedisStore.from_url(settings.redis_url)
            cold, warm, texts = [], [], set()
            for rep in range(reps):
                deadline = time.monotonic() + 120
                while not at_zero(client, store):
                    if time.monotonic() > deadline:
                        raise TimeoutError("the stages did not go to zero")
                    time.sleep(0.2)
                time.sleep(1.0)  # the deregistered replicas' processes exit
                seconds, answer = timed(client)
                cold.append(seconds)
                texts.add(answer["text"])
                seconds, answer = timed(client)  # right after: every stage is up
                warm.append(seconds)
                texts.add(answer["text"])
                print(f"  warm runtime {warm_runtime}, rep {rep}: from zero {cold[-1]:.2f} s, warm {warm[-1]:.2f} s",
                      flush=True)
            return {"cold": cold, "warm": warm, "same_text": len(texts) == 1}
        finally:
            control.down(settings)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    base = load_settings()
    runs = {on: one_runtime(base, on, args.reps) for on in (True, False)}
    med = statistics.median
    figures, rows = [], []
    for on, run in runs.items():
        how = "forked from the runtime zygote" if on else "new processes"
        figures += [{"name": f"request from zero, cold replicas as {how}", "value": round(med(run["cold"]), 3),
                     "unit": "s", "samples": [round(x, 3) for x in run["cold"]]},
                    {"name": f"same request on the warm model ({how} run)", "value": round(med(run["warm"]), 3),
                     "unit": "s", "samples": [round(x, 3) for x in run["warm"]]}]
        rows.append([how, med(run["cold"]), med(run["warm"]), run["same_text"]])
    print(table(f"{MODEL}, {BODY['max_new_tokens']} new tokens, medians of {args.reps} (s)",
                ["cold replicas", "from zero", "warm", "same text"], rows))
    # With QUART_COMPILE=false: what the background compiles that follow every start cost (kept apart).
    name = "scale_to_zero" if base.compute.compiles else "scale_to_zero_eager"
    path = write(name, figures, conditions(model=MODEL, stages=STAGES, idle=IDLE, body=BODY, reps=args.reps,
                                           cache_stages="none", page_cache="left as it was"))
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
