"""λScale's locality-driven start on the embedded runtime (QUART_VIRTUAL_DISKS): SmolLM2's stage 1
(a 156 MB shard) cached on the first of N + 1 virtual servers, each with its own models folder
behind a link of --bandwidth, the model store behind one of --store-bandwidth; the stage, made a
key stage, is scaled from one replica to N + 1, so that N new replicas go to the N other servers.
With peer starts (the default) the scheduler sends the stage to them by one multicast from the
server that caches it; with QUART_ABLATE=peer-start each reads it from the store. Measured: the
time from each new replica's placement until it answers its health check (the `ready` records in
quart:placements), beside the scheduler's prediction of the shard's arrival (which leaves out the
replica's own start, about a second here).

    python -m benchmarks peer_start [--servers 2 4] [--bandwidth 5e7] [--store-bandwidth 2.5e7]
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
from contracts.stack import one_model_stack
from contracts.stage import StageRef
from keysmanager.client import KeysClient
from models.partition import ensure_partitioned
from runtime import __main__ as control
from runtime.ports import free_port
from scheduler.placement import SchedulerParams
from state.records import Placement
from state.store import RedisStore

MEASURES = SERVING  # the code measured (benchmarks/freshness.py)

MODEL, STAGE = "smollm2", "1"
BODY = {"prompt": "The capital of France is", "max_new_tokens": 8, "ignore_eos": True}


def wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} in {timeout_s:g} s")
        time.sleep(0.2)


def scale_out(base: Settings, n: int, peers: bool, bandwidth: float, store_bandwidth: float) -> dict:
    """One runtime of n + 1 servers; the stage scaled from 1 to n + 1 replicas."""
    with scratch("quart-peer-") as home:
        settings = base.replace(
            home=str(home), models=str(base.models_dir),
            stack_file=str(one_model_stack(REPO_ROOT / "stack.yml", home / "stack.yml", MODEL)),
            gateway_port=free_port(), redis_port=free_port(), keysmanager_port=free_port(), policy="none",
            server="bench", virtual_servers=n + 1, server_slots=8, virtual_disks=True, server_bandwidth=bandwidth,
            store_bandwidth=store_bandwidth, cold_deadline_s=600.0, cache_stages=f"{MODEL}:{STAGE}",
            ablate="" if peers else "peer-start", request_timeout_s=300.0, admit_wait_s=0.0)
        first = settings.virtual_server_names()[0]
        try:
            if control.up(settings, timeout=600) != 0:
                raise RuntimeError("the runtime did not come up")
            client, store = GatewayClient.for_settings(settings), RedisStore.from_url(settings.redis_url)
            keys = KeysClient.for_settings(settings.virtual_server(first), timeout=60)
            wait(lambda: any(z["stages"] == STAGE for z in keys.zygotes()), 600, f"stage {STAGE} cached on {first}")
            wait(lambda: all(f["availableReplicas"] >= 1 for f in client.functions()), 600, "every function ready")
            store.publish_key_stages(MODEL, (StageRef.parse(MODEL, STAGE),))
            before = len(store.placements())
            started = time.monotonic()
            if client.scale(f"{MODEL}-s{STAGE}", n + 1).status != 202:
                raise RuntimeError("the scale call was refused")

            def ready() -> list[Placement]:
                return [p for p in store.placements()[before:] if p.op == "ready"]
            wait(lambda: len(ready()) >= n, 900, f"{n} ready replicas")
            wall = time.monotonic() - started
            added = [p for p in store.placements()[before:] if p.op == "add"]
            reply = client.invoke(MODEL, BODY)
            if reply.status != 200:
                raise RuntimeError(f"{reply.status}: {reply.body[:200]!r}")
            done = ready()
            print(f"  N = {n}, {'peers' if peers else 'store'}: {[p.path for p in added]} on {[p.server for p in added]}, "
                  f"ready after {[round(p.took_s, 2) for p in done]} s (predicted {done[0].predicted_s:.2f} s)", flush=True)
            return {"paths": sorted({p.path for p in added}), "servers": sorted(p.server for p in added),
                    "took_s": [round(p.took_s, 3) for p in done], "predicted_s": round(done[0].predicted_s, 3),
                    "all_ready_s": round(wall, 3), "text": reply.json()["text"]}
        finally:
            control.down(settings)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", type=int, nargs="+", default=[2, 4], help="new servers N")
    parser.add_argument("--bandwidth", type=float, default=5e7, help="bytes/s of each server's link")
    parser.add_argument("--store-bandwidth", type=float, default=2.5e7, help="bytes/s of the store's link")
    args = parser.parse_args(argv)
    base = load_settings()
    stage_bytes = ensure_partitioned(base.models_dir, MODEL, 4).stages[int(STAGE)].bytes
    runs = {(n, peers): scale_out(base, n, peers, args.bandwidth, args.store_bandwidth)
            for n in args.servers for peers in (True, False)}
    figures, rows = [], []
    for n in args.servers:
        peer, cold = runs[(n, True)], runs[(n, False)]
        for name, run in (("peer start", peer), ("store (peer-start ablated)", cold)):
            last = max(run["took_s"])
            figures += [{"name": f"N = {n}, {name}: last new replica ready", "value": last, "unit": "s",
                         "samples": run["took_s"], "paths": run["paths"]},
                        {"name": f"N = {n}, {name}: predicted shard arrival", "value": run["predicted_s"], "unit": "s"}]
            rows.append([n, name, "/".join(run["paths"]), statistics.median(run["took_s"]), last, run["predicted_s"]])
        figures.append({"name": f"N = {n}: store / peer, last replica ready", "unit": "x",
                        "value": round(max(cold["took_s"]) / max(peer["took_s"]), 3)})
    same = len({run["text"] for run in runs.values()}) == 1
    print(table(f"{MODEL} stage {STAGE} ({stage_bytes / 1e6:.0f} MB) to N new servers: links {args.bandwidth / 1e6:g} "
                f"MB/s, store {args.store_bandwidth / 1e6:g} MB/s; one run each (s)",
                ["N", "start", "path", "median ready", "last ready", "predicted arrival"], rows))
    print(f"same answer in every run: {same}")
    path = write("peer_start", figures, conditions(
        model=MODEL, stage=STAGE, stage_bytes=stage_bytes, server_bandwidth=args.bandwidth,
        store_bandwidth=args.store_bandwidth, servers=args.servers, blocks=SchedulerParams().peer_blocks, runs_per_arm=1,
        same_answer=same, note="ready: from the replica's placement to its first passing health check"))
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
