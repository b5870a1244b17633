"""Pipeline consolidation and split (HydraServe §6, Fig. 12) on the embedded runtime, as a user
runs it: SmolLM2 in 4 stage functions (a torch thread each) plus its whole-model function (a
torch thread per core: the cores the stage replicas share), b requests generating N tokens
each, scaled by hand through the gateway in four phases per repetition:

- pipelined: the 4 stage replicas serve the requests;
- consolidation: they start on the stages; the whole replica is started (it loads every shard
  while they generate), then the stage replicas are removed and the requests' caches gathered
  into it, each on its next step;
- never split: the whole replica alone serves them from the start;
- split: they start on the whole replica; the stage replicas come back, the whole replica is
  removed and the caches are split over the stages.

Each token's time is read from the stages' records in Redis (when the last stage, or the whole
replica, finished the step), so per-token times are exact. Shards on this machine's disk (the
page cache left as it is).

    python -m benchmarks consolidation [--reps 3] [--tokens 192] [--batches 1 4]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.report import RESULTS, SERVING, conditions, scratch, table, write
from contracts.config import Settings, load_settings
from contracts.http_client import GatewayClient
from contracts.paths import REPO_ROOT
from contracts.stack import consolidating_stack
from loadgen.sharegpt import first_prompts
from runtime import __main__ as control
from runtime.ports import free_port
from state.store import RedisStore

MEASURES = SERVING + ("loadgen",)  # the code measured (benchmarks/freshness.py)

MODEL, STAGES = "smollm2", 4
WHOLE, NARROW = f"{MODEL}-whole", [f"{MODEL}-s{i}" for i in range(STAGES)]
PHASES = ("pipelined", "consolidation", "never split", "split")
BEFORE_S = 2.0  # how long requests generate before the change starts
# The whole replica computes with a thread per core: the cores its 4 stage replicas shared.
CORES = len(os.sched_getaffinity(0))


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


class Bench:
    def __init__(self, settings: Settings, tokens: int) -> None:
        self.client = GatewayClient.for_settings(settings)
        self.store = RedisStore.from_url(settings.redis_url)
        self.tokens = tokens
        self.prompts = first_prompts(16, seed=3, max_chars=200)

    # -- scaling by hand ---------------------------------------------------------------------

    def scale(self, name: str, replicas: int) -> None:
        reply = self.client.scale(name, replicas)
        if reply.status not in (200, 202):
            raise RuntimeError(f"scaling {name}: {reply.status} {reply.body[:200]!r}")

    def wait(self, what: str, predicate, timeout: float = 120) -> float:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(what)
            time.sleep(0.05)
        return time.time()

    def serving(self, stage: int, end: int) -> int:
        return sum(1 for x in self.store.live_replicas(MODEL, stage)
                   if x.stage_end == end and x.stage_start == stage and not x.draining)

    def gone(self, name: str) -> bool:
        return self.client.request("GET", f"/system/function/{name}").json()["availableReplicas"] == 0

    def holding(self, end: int, count: int, since: float) -> bool:
        found = [x for x in self.store.live_replicas(MODEL, 0) if x.stage_end == end]
        return bool(found) and all(x.last_seen > since for x in found) and \
            sum(x.sequences for x in found) >= count

    def change(self, whole: bool, events: dict[str, float]) -> None:
        """To the whole replica (or back to the stage replicas): the new side started and serving,
        then the old side told to go; `events` gets when each began."""
        events["load"] = time.time()
        if whole:
            self.scale(WHOLE, 1)
            events["live"] = self.wait("whole", lambda: self.serving(0, STAGES) == 1)
        else:
            for name in NARROW:
                self.scale(name, 1)
            events["live"] = self.wait("stages", lambda: all(self.serving(i, i + 1) == 1 for i in range(STAGES)))
        for name in NARROW if whole else [WHOLE]:
            self.scale(name, 0)
        events["handover"] = time.time()

    def gone_all(self, whole: bool) -> None:
        """The side `change` told to go has no replica left."""
        old = NARROW if whole else [WHOLE]
        self.wait("the old replicas gone", lambda: all(self.gone(n) for n in old))

    def layout(self, whole: bool) -> None:
        """Only the whole replica, or only the stage replicas, serving."""
        self.change(whole, {})
        self.gone_all(whole)

    # -- one phase ---------------------------------------------------------------------------

    def phase(self, name: str, batch: int) -> dict:
        """The phase's requests and its events (times of the changes it made)."""
        events: dict[str, float] = {}
        done: list = []
        failed: list[BaseException] = []
        since = time.time()

        def send() -> None:
            try:
                done.extend(self.send(batch))
            except BaseException as exc:  # raised below, in the benchmark's thread
                failed.append(exc)

        sender = threading.Thread(target=send)
        sender.start()
        if name in ("consolidation", "split"):
            whole = name == "consolidation"  # starting on the stages, or on the whole replica
            self.wait("requests generating", lambda: self.holding(1 if whole else STAGES, batch, since))
            time.sleep(BEFORE_S)  # some tokens before the change
            self.change(whole, events)
        sender.join()
        if failed:
            raise RuntimeError(f"{name}, {batch} request(s): a request failed") from failed[0]
        if events:
            self.gone_all(whole)
        return {"requests": done, "events": events}

    def send(self, batch: int) -> list[dict]:
        def one(prompt: str) -> dict:
            started = time.time()
            reply = self.client.invoke(MODEL, {"prompt": prompt, "max_new_tokens": self.tokens, "ignore_eos": True})
            if reply.status != 200:
                raise RuntimeError(f"{reply.status}: {reply.body[:200]!r}")
            return {**reply.json(), "started": started, "finished": time.time()}
        with ThreadPoolExecutor(batch) as pool:
            return list(pool.map(one, self.prompts[:batch]))

    def token_times(self, request_ids: set[str]) -> dict[str, list[tuple[float, str]]]:
        """Per request: (when each step finished, the replica that finished it), in step order,
        from the records of the last stage and of the whole replica."""
        steps: dict[str, dict[int, tuple[float, str]]] = {}
        for stage in (STAGES - 1, 0):
            for x in self.store.samples(MODEL, stage):
                rid, _, step = x.request_id.split(".")
                whole_replica = x.replica_id.startswith(f"{MODEL}-s0-{STAGES}.")
                if rid in request_ids and (stage == STAGES - 1 or whole_replica):
                    finished = x.arrived_at + (x.wait_ms + x.service_ms) / 1000.0
                    steps.setdefault(rid, {})[int(step)] = (finished, "whole" if whole_replica else "stages")
        return {rid: [s[i] for i in sorted(s)] for rid, s in steps.items()}


def gaps(times: dict[str, list[tuple[float, str]]], lo: float = 0.0, hi: float = float("inf"),
         served_by: str | None = None) -> list[float]:
    """Time per output token (s) of the steps that finished within (lo, hi), by `served_by`
    when given, each step's gap to the step before it."""
    out = []
    for steps in times.values():
        for (t0, _), (t1, by) in zip(steps, steps[1:]):
            if lo < t1 < hi and (served_by is None or by == served_by):
                out.append(t1 - t0)
    return out


def summarise(bench: Bench, name: str, run: dict) -> dict:
    times = bench.token_times({x["id"] for x in run["requests"]})
    ev = run["events"]
    e2e = statistics.mean(x["finished"] - x["started"] for x in run["requests"])
    out = {"tpot": statistics.median(gaps(times)), "e2e": e2e, "recomputes": sum(x["recomputes"] for x in run["requests"]),
           "tokens": {rid: [t for t, _ in s] for rid, s in times.items()}, "events": ev}
    if name in ("consolidation", "split"):
        after = "whole" if name == "consolidation" else "stages"
        firsts = [next(t for t, by in s if by == after) for s in times.values() if any(by == after for _, by in s)]
        handed = max(firsts) if firsts else float("inf")
        out.update(before=median(gaps(times, hi=ev["load"])), loading=median(gaps(times, ev["load"], ev["live"])),
                   after=median(gaps(times, lo=handed, served_by=after)),
                   handover_s=handed - ev["handover"], handed=len(firsts))
    return out


def one_runtime(base: Settings, reps: int, tokens: int, batches: list[int]) -> dict:
    with scratch("quart-consolidation-") as home:
        settings = base.replace(home=str(home), models=str(base.models_dir), gateway_port=free_port(),
                                redis_port=free_port(), keysmanager_port=free_port(), cache_stages="none", policy="none",
                                request_timeout_s=300.0, max_new_tokens=tokens, drain_timeout_s=60.0,
                                stack_file=str(consolidating_stack(REPO_ROOT / "stack.yml", home / "stack.yml", MODEL,
                                                                   environment={"QUART_THREADS": str(CORES)})))
        try:
            if control.up(settings, timeout=600) != 0:
                raise RuntimeError("the runtime did not come up")
            bench = Bench(settings, tokens)
            bench.layout(whole=False)
            runs: dict = {}
            for rep in range(reps):
                for batch in batches:
                    for name in PHASES:
                        if name == "never split":
                            bench.layout(whole=True)
                        run = summarise(bench, name, bench.phase(name, batch))
                        runs.setdefault((batch, name), []).append(run)
                        print(f"  rep {rep}, {batch} request(s), {name}: TPOT {run['tpot'] * 1000:.1f} ms"
                              + (f", before {run['before'] * 1000:.1f}, while loading {run['loading'] * 1000:.1f}, "
                                 f"after {run['after'] * 1000:.1f} ms, handed over {run['handed']} in {run['handover_s']:.2f} s"
                                 if "after" in run else ""), flush=True)
        finally:
            control.down(settings)
    return runs


def plot(runs: dict, batch: int, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, colour in zip(PHASES, ("tab:blue", "tab:orange", "tab:green", "tab:red")):
        run = runs[(batch, name)][0]
        series = [sorted(ts) for ts in run["tokens"].values()]
        per_step = [statistics.mean(s[i] - s[i - 1] for s in series if len(s) > i) * 1000
                    for i in range(1, max(len(s) for s in series))]
        ax.plot(range(1, len(per_step) + 1), per_step, label=name, color=colour)
        after = [next((i for i, t in enumerate(s) if t >= run["events"]["handover"]), None)
                 for s in series] if "handover" in run["events"] else []
        after = [i for i in after if i is not None]  # none: the requests ended before the change
        if after:
            ax.axvline(statistics.median(after), color=colour, linestyle=":", linewidth=1)
    typical = statistics.median(y for line in ax.get_lines() if len(line.get_ydata()) > 2 for y in line.get_ydata())
    ax.set_ylim(0, 4 * typical)
    ax.set_xlabel("output token")
    ax.set_ylabel("time per output token (ms)")
    ax.set_title(f"{MODEL}: {batch} requests generating; dotted: the stage replicas (or the whole one) removed")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=192,
                        help="tokens per request: enough that requests still decode after the layout changes")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    args = parser.parse_args(argv)
    runs = one_runtime(load_settings(), args.reps, args.tokens, args.batches)
    med = statistics.median
    figures, rows = [], []
    for batch in args.batches:
        per = {name: runs[(batch, name)] for name in PHASES}
        cons, split = per["consolidation"], per["split"]
        # Ratios side by side: each repetition's phases ran one after the other, then the median.
        ratio = lambda xs, ys: med(x / y for x, y in zip(xs, ys))  # noqa: E731
        after_never = ratio([r["after"] for r in cons], [r["tpot"] for r in per["never split"]])
        split_piped = ratio([r["after"] for r in split], [r["tpot"] for r in per["pipelined"]])
        e2e = ratio([r["e2e"] for r in per["pipelined"]], [r["e2e"] for r in cons])
        ms = {name: [r[key] * 1000 for r in runs] for name, runs, key in (
            ("TPOT pipelined", per["pipelined"], "tpot"), ("TPOT never split", per["never split"], "tpot"),
            ("TPOT before consolidation", cons, "before"), ("TPOT while the whole replica loads", cons, "loading"),
            ("TPOT after consolidation", cons, "after"), ("TPOT before the split", split, "before"),
            ("TPOT while the stage replicas start", split, "loading"), ("TPOT after the split", split, "after"))}
        for name, samples in ms.items():
            figures.append({"name": f"{name}, {batch} request(s)", "value": round(med(samples), 2), "unit": "ms",
                            "samples": [round(x, 2) for x in samples]})
        for name, value, unit in (
                ("TPOT after consolidation / never split (same repetition)", after_never, "ratio"),
                ("TPOT after the split / pipelined (same repetition)", split_piped, "ratio"),
                ("generation time pipelined / with consolidation (same repetition)", e2e, "ratio"),
                ("consolidation handover: stage replicas removed to the last cache gathered",
                 med(r["handover_s"] for r in cons), "s"),
                ("split handover: whole replica removed to the last cache split", med(r["handover_s"] for r in split), "s"),
                ("requests prefilled again", sum(r["recomputes"] for runs in per.values() for r in runs), "requests")):
            figures.append({"name": f"{name}, {batch} request(s)", "value": round(value, 3), "unit": unit})
        rows.append([batch, med(ms["TPOT pipelined"]), med(ms["TPOT never split"]), med(ms["TPOT after consolidation"]),
                     after_never, med(ms["TPOT after the split"]), split_piped, e2e])
    print(table(f"{MODEL}, {args.tokens} tokens per request, medians of {args.reps} (TPOT in ms)",
                ["batch", "pipelined", "never split", "after consolidation", "after/never",
                 "after split", "after split/pipelined", "e2e pipelined/consolidated"], rows))
    png = RESULTS / "consolidation.png"
    plot(runs, max(args.batches), png)
    path = write("consolidation", figures, conditions(model=MODEL, stages=STAGES, tokens=args.tokens, reps=args.reps,
                                                      batches=args.batches, cache_stages="none",
                                                      page_cache="left as it was", plot=png.name))
    print(f"wrote {path} and {png}")


if __name__ == "__main__":
    main(sys.argv[1:])
