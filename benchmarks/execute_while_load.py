"""λScale's execute-while-load on the embedded runtime (QUART_VIRTUAL_DISKS): SmolLM2 (651 MB in
4 shards) served whole by two virtual servers that hold it, scaled out to two new ones while
requests keep coming. The new servers receive the model from both holders by one multicast, each
sub-group its half first; with execute-while-load (the default) each new whole replica gets the
model's stage functions beside it as stand-ins, which answer as a pipeline across the new servers
before either holds the whole model; with QUART_EXECUTE_WHILE_LOAD=false the new servers answer
once their whole replicas are ready. Measured from the scale call: the first answer computed
entirely on the new servers, the first new whole replica ready, and the answers in between.

On this 2-core machine the new servers add no compute (every virtual server shares the same two
cores): what means something here is when the new servers start answering; the stand-ins' loading
competes with the serving replicas for the cores. The link speed is set low enough that the
transfer, not the cores, sets the pace of the scale-out.

    python -m benchmarks execute_while_load [--bandwidth 2.5e7] [--senders 2]
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from benchmarks.peer_start import wait
from benchmarks.report import RESULTS, SERVING, conditions, scratch, table, write
from contracts.config import Settings, load_settings
from contracts.http_client import GatewayClient
from contracts.paths import REPO_ROOT
from contracts.stack import consolidating_stack
from contracts.stage import StageRef
from keysmanager.client import KeysClient
from models.partition import ensure_partitioned
from runtime import __main__ as control
from runtime.ports import free_port
from state.store import RedisStore

MEASURES = SERVING + ("loadgen",)  # the code measured (benchmarks/freshness.py)

MODEL, WHOLE = "smollm2", "smollm2-whole"
WHOLE_STAGES = StageRef(MODEL, 0, 4)  # what the whole function serves
STAGE_FUNCTIONS = tuple(f"{MODEL}-s{i}" for i in range(4))
BODY = {"prompt": "The capital of France is", "max_new_tokens": 8, "ignore_eos": True}


def settings_for(base: Settings, home: Path, bandwidth: float, execute_while_load: bool = True) -> Settings:
    """Four virtual servers with their own models folders behind links of `bandwidth`, the store
    behind one as fast: two new servers reading the model from it share it (2·M/B), receiving it
    from two holders they do not (M/B), so the scheduler sends it by peers."""
    stack = consolidating_stack(REPO_ROOT / "stack.yml", home / "whole.yml", MODEL)
    spec = yaml.safe_load(stack.read_text())
    spec["functions"][WHOLE]["labels"]["com.openfaas.scale.max"] = "4"
    stack.write_text(yaml.safe_dump(spec, sort_keys=False))
    return base.replace(
        home=str(home), models=str(base.models_dir), stack_file=str(stack), gateway_port=free_port(),
        redis_port=free_port(), keysmanager_port=free_port(), policy="none", server="vs", virtual_servers=4,
        server_slots=8, virtual_disks=True, cache_stages="none", server_bandwidth=bandwidth,
        store_bandwidth=bandwidth, cold_deadline_s=600.0, request_timeout_s=300.0, admit_wait_s=0.0,
        drain_timeout_s=60.0, execute_while_load=execute_while_load)


def ready(client: GatewayClient) -> dict[str, int]:
    return {f["name"]: f["availableReplicas"] for f in client.functions()}


def keys(settings: Settings, server: str) -> KeysClient:
    """Its default timeout: longer than a zygote's start (KeysManager's own deadline)."""
    return KeysClient.for_settings(settings.virtual_server(server))


def prepare(settings: Settings) -> tuple[list[str], list[str]]:
    """The model served whole by two servers that hold it on their own disks (cached), nothing of
    it on the other two: every function of the model at zero but the entry and two whole
    replicas. The holders and the new servers."""
    client, store = GatewayClient.for_settings(settings), RedisStore.from_url(settings.redis_url)
    holders, targets = settings.virtual_server_names()[:2], settings.virtual_server_names()[2:]
    for name in (WHOLE, *STAGE_FUNCTIONS):
        if client.scale(name, 0).status != 202:
            raise RuntimeError(f"scaling {name} to zero was refused")
    wait(lambda: all(ready(client)[n] == 0 for n in (WHOLE, *STAGE_FUNCTIONS)), 180, "the model's functions at zero")
    for name in targets:
        own = settings.virtual_server(name)
        shutil.rmtree(own.model_dir(MODEL), ignore_errors=True)
        shutil.rmtree(own.prefetch_dir(name) / MODEL, ignore_errors=True)
    for name in holders:
        shutil.copytree(settings.model_dir(MODEL), settings.virtual_server(name).model_dir(MODEL), dirs_exist_ok=True)
        keys(settings, name).cache(WHOLE_STAGES)
    for name in holders:
        wait(lambda name=name: any(z["stages"] == WHOLE_STAGES.stages for z in keys(settings, name).zygotes()), 600,
             f"the whole model cached on {name}")
        keys(settings, name).settled(WHOLE_STAGES)  # no compile left beside the cold starts measured
    store.publish_key_stages(MODEL, (WHOLE_STAGES,))  # spread its replicas over the servers
    if client.scale(WHOLE, 2).status != 202:
        raise RuntimeError("scaling the whole function to 2 was refused")
    wait(lambda: ready(client)[WHOLE] == 2, 600, "two whole replicas")
    return holders, targets


@dataclass
class Answer:
    at: float                 # time.time() when it came
    status: int
    latency_s: float
    servers: tuple[str, ...]  # each stage's replica's server, from the answer's timings
    text: str


@dataclass
class Senders:
    """`count` clients sending BODY one after another until stopped."""
    client: GatewayClient
    count: int
    answers: list[Answer] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def _send(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            reply = self.client.invoke(MODEL, BODY)
            body = reply.json() if reply.status == 200 else {}
            self.answers.append(Answer(time.time(), reply.status, time.monotonic() - started,
                                       tuple(s["replica"].split(".")[1] for s in body.get("stages", [])),
                                       body.get("text", "")))

    @contextmanager
    def running(self) -> Iterator[Senders]:
        threads = [threading.Thread(target=self._send, daemon=True) for _ in range(self.count)]
        for t in threads:
            t.start()
        try:
            yield self
        finally:
            self._stop.set()
            for t in threads:
                t.join(timeout=300)


def scale_out(settings: Settings, senders: int) -> dict:
    """Whole replicas from 2 to 4 under `senders` clients, until the new ones are ready and the
    stand-ins gone; what happened, in seconds from the scale call."""
    client, store = GatewayClient.for_settings(settings), RedisStore.from_url(settings.redis_url)
    holders, targets = prepare(settings)
    with Senders(client, senders).running() as sent:
        time.sleep(5.0)  # the load before
        before, t0 = len(store.placements()), time.time()
        if client.scale(WHOLE, 4).status != 202:
            raise RuntimeError("scaling the whole function to 4 was refused")
        wait(lambda: ready(client)[WHOLE] == 4, 900, "four whole replicas")
        wait(lambda: all(ready(client)[n] == 0 for n in STAGE_FUNCTIONS), 300, "no stand-in left")
        time.sleep(5.0)  # and after
    placed = store.placements()[before:]
    whole_ready = min(p.t for p in placed if p.op == "ready" and p.stage == WHOLE_STAGES.key)
    on_new = [a for a in sent.answers if a.at > t0 and a.servers and set(a.servers) <= set(targets)]
    across = [a for a in on_new if len(a.servers) == 4 and len(set(a.servers)) == 2]
    after = [a for a in sent.answers if a.at > t0]
    where = {"stand-ins": [(a.at - t0, a.latency_s) for a in on_new if len(a.servers) == 4],
             "new whole replicas": [(a.at - t0, a.latency_s) for a in on_new if len(a.servers) == 1],
             "holders": [(a.at - t0, a.latency_s) for a in sent.answers if a.servers and a not in on_new]}
    return {"where": where,
            "paths": sorted({p.path for p in placed if p.op == "add" and p.stage == WHOLE_STAGES.key}),
            "stand_ins": sum(p.op == "add" and "execute-while-load" in p.reason for p in placed),
            "first_new_s": min(a.at for a in on_new) - t0 if on_new else None,
            "first_across_s": min(a.at for a in across) - t0 if across else None,
            "whole_ready_s": whole_ready - t0,
            "answered_by_stand_ins": sum(len(a.servers) == 4 for a in on_new),
            "answers": len(after), "failed": sum(a.status != 200 for a in after),
            "latency_p50_s": statistics.median(a.latency_s for a in after),
            "texts": sorted({a.text for a in sent.answers if a.status == 200}), "holders": holders, "targets": targets}


def plot(runs: dict[bool, dict], path: Path) -> None:
    """Each answer's latency at the time it came, by where it was computed, one panel an arm."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    for ax, (on, run) in zip(axes, runs.items()):
        for (label, points), colour in zip(run["where"].items(), ("tab:blue", "tab:orange", "tab:green")):
            if points:
                ax.scatter(*zip(*points), s=14, label=label, color=colour)
        ax.axvline(run["whole_ready_s"], color="grey", ls="--", lw=1, label="first new whole replica ready")
        ax.axvline(0.0, color="black", lw=0.8)
        ax.set(title="execute-while-load" if on else "whole replicas only", xlabel="s from the scale call",
               ylabel="latency (s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def one(base: Settings, bandwidth: float, senders: int, execute_while_load: bool) -> dict:
    with scratch("quart-ewl-") as home:
        settings = settings_for(base, home, bandwidth, execute_while_load)
        try:
            if control.up(settings, timeout=900) != 0:
                raise RuntimeError("the runtime did not come up")
            return scale_out(settings, senders)
        finally:
            control.down(settings)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bandwidth", type=float, default=2.5e7, help="bytes/s of each server's link and the store's")
    parser.add_argument("--senders", type=int, default=2, help="clients sending one request after another")
    args = parser.parse_args(argv)
    base = load_settings()
    model_bytes = sum(s.bytes for s in ensure_partitioned(base.models_dir, MODEL, 4).stages)
    runs = {}
    for on in (True, False):
        print(f"execute-while-load {'on' if on else 'off'}: a runtime of four servers", flush=True)
        runs[on] = one(base, args.bandwidth, args.senders, on)
    rows, figures = [], []
    for on, run in runs.items():
        arm = "execute-while-load" if on else "whole replicas only"
        rows.append([arm, "/".join(run["paths"]), run["stand_ins"], run["first_new_s"], run["first_across_s"],
                     run["whole_ready_s"], run["answered_by_stand_ins"], run["answers"], run["failed"],
                     run["latency_p50_s"]])
        for key, unit in (("first_new_s", "s"), ("first_across_s", "s"), ("whole_ready_s", "s"),
                          ("answered_by_stand_ins", "requests"), ("answers", "requests"), ("failed", "requests"),
                          ("latency_p50_s", "s")):
            figures.append({"name": f"{arm}: {key}", "value": run[key], "unit": unit})
    on, off = runs[True], runs[False]
    if on["first_new_s"] and off["first_new_s"]:
        figures.append({"name": "first answer on the new servers: whole only / execute-while-load", "unit": "x",
                        "value": round(off["first_new_s"] / on["first_new_s"], 3)})
    same = len({t for run in runs.values() for t in run["texts"]}) == 1
    print(table(f"{MODEL} ({model_bytes / 1e6:.0f} MB) whole from 2 to 4 servers under {args.senders} senders, links "
                f"{args.bandwidth / 1e6:g} MB/s; one run each (s from the scale call)",
                ["arm", "path", "stand-ins", "first answer on new", "first across new", "new whole ready",
                 "answered by stand-ins", "answers", "failed", "latency p50"], rows))
    print(f"one answer text in every run: {same}")
    plot(runs, RESULTS / "execute_while_load.png")
    path = write("execute_while_load", figures, conditions(
        model=MODEL, model_bytes=model_bytes, bandwidth=args.bandwidth, senders=args.senders, runs_per_arm=1,
        same_answer=same, servers=4, note="the first answer on new servers: every stage of it computed on them"))
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
