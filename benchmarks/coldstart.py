"""Cold start from zero to the first token, HydraServe's way (its Fig. 8): a random-weight LLaMA
of about 2 GB in 4 stages, no replica anywhere, a prompt waiting in stage 0's stream. Each
variant adds one mechanism to the one before:

  sequential   one process for the whole model: start, import, fetch from the store, load, prefill
  +prefetch    the server's prefetcher pulls the shards into shared memory from the moment of
               placement, while the process starts and imports (HydraServe §5.1)
  +stream      tensors are made as their bytes arrive instead of after the whole shard (§5.2)
  +overlap     the process starts reading its shards before it imports torch (§5)
  +parallel s  s workers on s servers, each fetching and loading 1/s of the model (§4)
  +runtime s   and each worker forked from its server's runtime zygote (libraries imported, no
               parameters: QUART_WARM_RUNTIME), so neither process creation nor imports remain

The model store stands for remote storage: each connection is paced to --bandwidth (one
server's link; HydraServe's testbed has 16 Gbps), so s servers fetch over s links. The page cache
is dropped before each trial where the machine allows (the store then reads from disk and every
process imports its libraries from disk, as on a cold node); the JSON says which.

Algorithm 1 as the runtime runs it when a model wakes (scheduler/wake_layout.py: the whole model,
or its 4 stage functions on servers of their own, the servers sharing this machine's cores) chooses
from the calibration, for TTFT objectives below, between and above the two layouts' predictions;
its choice's measured TTFT is set beside each fixed layout's (+overlap s=1 is the whole model,
+parallel s=4 the stage functions). The two layouts also start over a slower link
(--slow-bandwidth), where the stages' parallel fetch outweighs their imports.

The predictors are calibrated on the sequential and +prefetch runs (process creation, imports,
prefill, the link's measured rate, the CPU a fetched byte costs) and predict every variant: Eq. 1
where nothing overlaps, Eq. 5 where it does, and each also bounded below by the run's CPU work over
this machine's cores (the servers are emulated on one machine).

    python -m benchmarks coldstart                      # or: python -m benchmarks.coldstart --reps 3
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import redis
import torch

from benchmarks.report import RESULTS, SERVING, conditions, scratch, table, write
from contracts.config import Settings, child_environment, load_settings
from contracts.paths import REPO_ROOT, STAGE_HANDLER
from contracts.proc_stat import started_at
from contracts.stage import StageRef
from contracts.wire import MESSAGE_FIELD, Header, pack, unpack
from keysmanager.client import KeysClient
from models.sampling import Sampling
from runtime.functions import start_watchdog
from runtime.ports import free_port
from runtime.redis_server import start_redis
from scheduler.coldstart import ColdServer, ColdStartCosts, shared_host_s, stage_ranges, ttft_overlapped, ttft_sequential
from scheduler.wake_layout import choose
from state import keys
from state.store import RedisStore

MEASURES = SERVING  # the code measured (benchmarks/freshness.py)

MODEL = "coldstart-2g"
CONFIG = {"hidden_size": 2048, "num_hidden_layers": 8, "intermediate_size": 5632, "num_attention_heads": 16,
          "num_key_value_heads": 16, "vocab_size": 32000}
STAGES = 4
PROMPT = list(range(1, 33))
HOP_S = 0.001  # a Redis hop of a prompt's activations (benchmarks/results/hop.json: 0.7 ms)


@dataclass(frozen=True)
class Variant:
    name: str
    prefetch: bool
    stream: bool
    overlap: bool
    size: int
    runtime: bool = False


VARIANTS = [Variant("sequential", False, False, False, 1), Variant("+prefetch", True, False, False, 1),
            Variant("+stream", True, True, False, 1), Variant("+overlap", True, True, True, 1),
            Variant("+parallel s=2", True, True, True, 2), Variant("+parallel s=4", True, True, True, 4),
            Variant("+runtime s=1", True, True, True, 1, True), Variant("+runtime s=2", True, True, True, 2, True),
            Variant("+runtime s=4", True, True, True, 4, True)]


def cpu_s(procs: list) -> float:
    """CPU seconds (user and system) the processes have used so far."""
    return sum(sum(psutil.Process(p.pid).cpu_times()[:2]) for p in procs)


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


class Bench:
    def __init__(self, settings: Settings, bandwidth: float, work: Path) -> None:
        self.settings, self.bandwidth, self.work = settings, bandwidth, work
        self.procs: list[subprocess.Popen] = []
        self._children: list[subprocess.Popen] = []
        self.store_procs: list[subprocess.Popen] = []
        self.km_procs: list[subprocess.Popen] = []
        (work / "logs").mkdir(parents=True, exist_ok=True)
        self.stores = []
        for i in range(STAGES):  # one link to the store per server
            port = free_port()
            self.store_procs.append(self._spawn([sys.executable, "-m", "runtime.model_store", "--models",
                                                 str(settings.models_dir), "--port", str(port), "--bandwidth",
                                                 str(bandwidth)], f"store-{i}"))
            self.stores.append(f"http://127.0.0.1:{port}")
        self.base = settings.replace(home=str(work), redis_port=free_port(),
                                     cache_stages="none", threads=1, drain_timeout_s=1.0)
        self.km_ports = [free_port() for _ in range(STAGES)]
        self.procs.append(start_redis("127.0.0.1", self.base.redis.port, work / "redis", work / "logs" / "redis.log"))
        self.r = redis.Redis.from_url(self.base.redis_url)
        self.kms = [self._keysmanager(i) for i in range(STAGES)]
        for km in self.kms:  # each with its runtime zygote up, so that no trial shares the CPUs with them
            deadline = time.monotonic() + 300
            while not (km.healthy() and km.stats()["runtime_zygote"]):
                if time.monotonic() > deadline:
                    raise TimeoutError("a KeysManager or its runtime zygote did not start")
                time.sleep(0.5)

    def _spawn(self, cmd: list[str], name: str, env: dict | None = None) -> subprocess.Popen:
        out = open(self.work / "logs" / f"{name}.log", "ab")
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env or child_environment(self.settings), stdout=out,
                                stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def server(self, i: int) -> Settings:
        return self.base.replace(server=f"srv-{i}", models=str(self.work / "replica-models" / f"srv-{i}"),
                                 models_url=self.stores[i],
                                 keysmanager_port=self.km_ports[i])

    def _keysmanager(self, i: int) -> KeysClient:
        settings = self.server(i).replace(models=str(self.work / "km-models" / f"srv-{i}"), warm_runtime=True)
        self.km_procs.append(self._spawn([sys.executable, "-m", "keysmanager"], f"keysmanager-{i}",
                                         child_environment(settings)))
        return KeysClient.for_settings(settings, timeout=60)

    def trial(self, v: Variant, page_cache_dropped: bool) -> dict:
        self.r.flushdb()
        shutil.rmtree(self.work / "replica-models", ignore_errors=True)
        if page_cache_dropped:
            drop_page_cache()
        ranges = stage_ranges(STAGES, v.size)
        seq = f"bench-{time.time_ns()}"
        cpu0 = {"stores": cpu_s(self.store_procs), "keysmanagers": cpu_s(self.km_procs)}
        t0 = time.time()
        if v.prefetch:  # the placement is decided: each server's prefetcher is told first
            for i, (a, b) in enumerate(ranges):
                self.kms[i].prefetch(StageRef(MODEL, a, b))
        workers = [self._start(i, StageRef(MODEL, a, b), v) for i, (a, b) in enumerate(ranges)]
        header = Header(request_id=f"{seq}.0", model=MODEL, stage=0, reply_to="quart:bench:coldstart",
                        deadline=t0 + 600, kind="prefill", seq=seq, capacity=len(PROMPT) + 4,
                        sampling=Sampling().to_dict())
        self.r.xadd(keys.stage_stream(MODEL, 0), {MESSAGE_FIELD: pack(header, {"input_ids": torch.tensor([PROMPT])})})
        got = None
        while got is None and time.time() < t0 + 600:
            got = self.r.blpop(["quart:bench:coldstart"], timeout=1)
            if not all(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in workers):
                raise RuntimeError(f"{v.name}: a worker exited; see {self.work / 'logs'}")
        token_at = time.time()
        if got is None:
            raise TimeoutError(f"{v.name}: no first token in 600 s")
        reply, out = unpack(got[1])
        if reply.error:
            raise RuntimeError(f"{v.name}: {reply.error}")
        cpu = {"replicas": sum(cpu_s([psutil.Process(pid)]) for pid in workers),
               "stores": cpu_s(self.store_procs) - cpu0["stores"],
               "keysmanagers": cpu_s(self.km_procs) - cpu0["keysmanagers"]}
        starts = [started_at(pid) for pid in workers]
        steps = [self._steps(a, t0) for a, _ in ranges]
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        for proc in self._children:
            proc.wait()
        self._children.clear()
        for km in self.kms:
            km.cancel_prefetch(MODEL)
        return {"ttft_s": token_at - t0, "token": int(out["token"][0]), "cpu_s": cpu,
                "workers": [{**s, "process_s": start - t0} for s, start in zip(steps, starts)]}

    def _start(self, i: int, stage: StageRef, v: Variant) -> int:
        """A worker on server i: a new process, or a fork of that server's runtime zygote."""
        settings = self.server(i).replace(stream_load=v.stream, overlap_imports=v.overlap)
        env = {"QUART_MODEL": MODEL, "QUART_STAGES": stage.stages}
        if v.runtime:
            env |= {"QUART_MODELS": str(settings.models_dir), "QUART_STREAM_LOAD": str(v.stream).lower(),
                    "QUART_OVERLAP_IMPORTS": str(v.overlap).lower()}
            return self.kms[i].start_cold(stage, f"{MODEL}-s{stage.first}", env)["pid"]
        proc = start_watchdog(settings, STAGE_HANDLER, env, None, self.work / "logs" / "replicas.log")
        self._children.append(proc)
        return proc.pid

    def _steps(self, first: int, t0: float) -> dict:
        for rid in self.r.smembers(keys.stage_replicas(MODEL, first)):
            rec = RedisStore(self.r).replica(rid.decode())
            c = rec.coldstart if rec else None
            if c:
                return {"imported_s": c.imported_at - t0, "fetch_started_s": c.fetch_started_at - t0,
                        "fetched_s": c.fetched_at - t0, "loaded_s": c.loaded_at - t0, "bytes": c.bytes}
        raise RuntimeError(f"the replica of stage {first} published no cold-start steps")

    def close(self) -> None:
        for p in reversed(self.procs):
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


@dataclass(frozen=True)
class Calibration:
    """HydraServe's history, from the sequential and +prefetch runs only: process creation,
    imports, prefill, the link's measured rate, and the CPU a fetched byte costs this machine."""
    costs: ColdStartCosts
    bandwidth: float          # b: bytes/s one server's fetch really got (the sequential runs)
    load_rate: float          # p: bytes/s tensors are made from fetched bytes (the +prefetch runs)
    cpu_per_byte: float       # CPU s per byte fetched straight from the store (store, replica)
    cpu_per_byte_prefetched: float  # the same through a prefetcher (store, prefetcher, replica)


def calibrate(trials: list[dict], model_bytes: float) -> Calibration:
    med = statistics.median
    seq = [t for t in trials if t["variant"] == "sequential"]
    pre = [t for t in trials if t["variant"] == "+prefetch"]
    first = [t["workers"][0] for t in seq]
    costs = ColdStartCosts(create_s=med(w["process_s"] for w in first),
                           libraries_s=med(w["imported_s"] - w["process_s"] for w in first),
                           prefill_s=med(t["ttft_s"] - t["workers"][0]["loaded_s"] for t in seq), decode_s=0.0,
                           hop_s=HOP_S)
    load = med(w["loaded_s"] - max(w["fetched_s"], w["imported_s"]) for w in (t["workers"][0] for t in pre))

    def per_byte(ts: list[dict]) -> float:  # all the CPU of a run but the imports and the prefill
        return med((sum(t["cpu_s"].values()) - costs.libraries_s - costs.prefill_s) / model_bytes for t in ts)

    return Calibration(costs, model_bytes / med(w["fetched_s"] - w["fetch_started_s"] for w in first),
                       model_bytes / max(load, 1e-3), per_byte(seq), per_byte(pre))


def predict(v: Variant, cal: Calibration, model_bytes: float, cores: int) -> tuple[float, float]:
    """(HydraServe's prediction, and it bounded below by the CPU work over this machine's cores).
    Eq. 1 where nothing overlaps; Eq. 5 once the fetch starts at placement (prefetch); a worker
    forked from a runtime zygote has neither process creation nor imports left. The s servers are
    emulated on one machine, so no cold start is faster than its CPU work (imports, the fetch's
    bytes through the store, prefetcher and reader, the prefill) spread over the cores."""
    costs = cal.costs
    servers = [ColdServer(f"srv-{i}", cal.bandwidth, cal.load_rate) for i in range(v.size)]
    if not v.prefetch:
        paper = ttft_sequential(costs, model_bytes, servers, v.size)
    else:
        if v.runtime:
            costs = dataclasses.replace(costs, create_s=0.0, libraries_s=0.0)
        paper = ttft_overlapped(costs, model_bytes, servers, v.size)
    per_byte = cal.cpu_per_byte_prefetched if v.prefetch else cal.cpu_per_byte
    return paper, max(paper, shared_host_s(costs, model_bytes, v.size, cores, per_byte))


WHOLE_VARIANT, STAGES_VARIANT = "+overlap", f"+parallel s={STAGES}"


def layout_choices(cal: Calibration, model_bytes: float, ttft: dict[str, float], cores: int) -> list[dict]:
    """Algorithm 1's wake layout for objectives below both layouts' predictions, between them and
    above both, with the measured TTFT (`ttft`: variant -> median) of its choice and of each
    layout. The servers share this machine's `cores`, as the embedded runtime's do."""
    servers = [ColdServer(f"srv-{i}", cal.bandwidth, cal.load_rate) for i in range(STAGES)]

    def chosen(objective: float | None):
        return choose(cal.costs, model_bytes, servers, STAGES, objective, shared_cores=cores,
                      cpu_per_byte=cal.cpu_per_byte_prefetched)

    low, high = sorted(chosen(None).predicted.values())
    rows = []
    for objective in (0.8 * low, (low + high) / 2, 1.25 * high):
        choice = chosen(objective)
        measured = ttft[WHOLE_VARIANT if choice.whole else STAGES_VARIANT]
        rows.append({"objective_s": objective, "chosen": "whole" if choice.whole else "stages",
                     "predicted_s": choice.plan.ttft_s, "measured_s": measured, "met": measured <= objective,
                     "whole_s": ttft[WHOLE_VARIANT], "whole_met": ttft[WHOLE_VARIANT] <= objective,
                     "stages_s": ttft[STAGES_VARIANT], "stages_met": ttft[STAGES_VARIANT] <= objective,
                     "reason": choice.reason})
    return rows


def plot(summary: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(summary) + 1.5))
    colours = {"start+imports": "#9ecae1", "fetch": "#fdae6b", "load": "#74c476", "prefill": "#de2d26"}
    for y, row in enumerate(summary):
        for w, step in enumerate(row["median_worker_steps"]):
            off = y + (w - (len(row["median_worker_steps"]) - 1) / 2) * 0.18
            ax.barh(off, step["imported_s"], left=0, height=0.16, color=colours["start+imports"])
            ax.barh(off, step["fetched_s"] - step["fetch_started_s"], left=step["fetch_started_s"], height=0.08,
                    color=colours["fetch"])
            ax.barh(off, max(0.0, step["loaded_s"] - max(step["fetched_s"], step["imported_s"])),
                    left=max(step["fetched_s"], step["imported_s"]), height=0.16, color=colours["load"])
        ax.plot([row["ttft_s"]], [y], "k|", markersize=18)
    ax.set_yticks(range(len(summary)), [r["variant"] for r in summary])
    ax.invert_yaxis()
    ax.set_xlabel("seconds from placement (| = first token)")
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()], labels=list(colours),
              loc="lower right")
    ax.set_title(f"Cold start of a {summary[0]['model_gb']:.2f} GB model, medians")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run(settings: Settings, bandwidth: float, variants: list[Variant], reps: int, dropped: bool) -> list[dict]:
    """`reps` trials of each variant over links of `bandwidth` bytes/s."""
    with scratch("quart-coldstart-") as work:
        bench = Bench(settings, bandwidth, work)
        trials = []
        try:
            for rep in range(reps):
                for v in variants:
                    t = bench.trial(v, dropped) | {"variant": v.name, "rep": rep}
                    print(f"  {bandwidth * 8 / 1e9:g} Gbps rep {rep} {v.name:15s} first token after {t['ttft_s']:.2f} s",
                          flush=True)
                    trials.append(t)
        finally:
            bench.close()
    return trials


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--bandwidth", type=float, default=2.5e8, help="bytes/s of each server's link to the store")
    parser.add_argument("--slow-bandwidth", type=float, default=5e7,
                        help="bytes/s of a slower link the two layouts also start over (0: none)")
    parser.add_argument("--warm-cache", action="store_true", help="leave the page cache as it is between trials")
    args = parser.parse_args(argv)
    settings = load_settings()
    from models.partition import ensure_partitioned
    manifest = ensure_partitioned(settings.models_dir, MODEL, STAGES, "random-llama", "balanced", CONFIG)
    model_bytes = float(sum(s.bytes for s in manifest.stages))
    dropped = not args.warm_cache and drop_page_cache()
    cores = len(os.sched_getaffinity(0))
    trials = run(settings, args.bandwidth, VARIANTS, args.reps, dropped)
    layouts = [v for v in VARIANTS if v.name in (WHOLE_VARIANT, STAGES_VARIANT)]
    slow = run(settings, args.slow_bandwidth, layouts, args.reps, dropped) if args.slow_bandwidth else []
    tokens = {t["token"] for t in trials + slow}
    cal = calibrate(trials, model_bytes)
    summary, figures = [], []
    base = statistics.median(t["ttft_s"] for t in trials if t["variant"] == "sequential")
    for v in VARIANTS:
        mine = [t for t in trials if t["variant"] == v.name]
        ttft = statistics.median(t["ttft_s"] for t in mine)
        steps = [{k: statistics.median(t["workers"][i][k] for t in mine) for k in mine[0]["workers"][i]}
                 for i in range(v.size)]
        paper, predicted = predict(v, cal, model_bytes, cores)
        summary.append({"variant": v.name, "ttft_s": ttft, "ratio": ttft / base, "predicted_s": predicted,
                        "error": (predicted - ttft) / ttft, "paper_s": paper, "paper_error": (paper - ttft) / ttft,
                        "median_worker_steps": steps,
                        "model_gb": model_bytes / 1e9})
        slowest = max(steps, key=lambda s: s["loaded_s"])
        figures += [
            {"name": f"{v.name} TTFT", "value": round(ttft, 3), "unit": "s", "samples": [round(t["ttft_s"], 3) for t in mine]},
            {"name": f"{v.name} TTFT / sequential", "value": round(ttft / base, 3), "unit": "ratio"},
            {"name": f"{v.name} predicted TTFT (paper)", "value": round(paper, 3), "unit": "s",
             "equation": "HydraServe Eq. 5" if v.prefetch else "HydraServe Eq. 1"},
            {"name": f"{v.name} prediction error (paper)", "value": round(100 * (paper - ttft) / ttft, 1), "unit": "%"},
            {"name": f"{v.name} predicted TTFT (with the CPU bound)", "value": round(predicted, 3), "unit": "s"},
            {"name": f"{v.name} prediction error (with the CPU bound)", "value": round(100 * (predicted - ttft) / ttft, 1),
             "unit": "%", "calibrated_on_this_variant": v.name in ("sequential", "+prefetch")},
            {"name": f"{v.name} CPU used", "value": round(statistics.median(sum(t["cpu_s"].values()) for t in mine), 2),
             "unit": "CPU s"},
            {"name": f"{v.name} slowest worker: process start", "value": round(slowest["process_s"], 3), "unit": "s"},
            {"name": f"{v.name} slowest worker: imports done", "value": round(slowest["imported_s"], 3), "unit": "s"},
            {"name": f"{v.name} slowest worker: fetch", "value": round(slowest["fetched_s"] - slowest["fetch_started_s"], 3),
             "unit": "s", "from_s": round(slowest["fetch_started_s"], 3)},
            {"name": f"{v.name} slowest worker: loaded", "value": round(slowest["loaded_s"], 3), "unit": "s"},
            {"name": f"{v.name} first token after load", "value": round(ttft - max(s["loaded_s"] for s in steps), 3),
             "unit": "s"}]
    rows = [[r["variant"], r["median_worker_steps"][0]["process_s"], max(s["imported_s"] for s in r["median_worker_steps"]),
             max(s["fetched_s"] - s["fetch_started_s"] for s in r["median_worker_steps"]),
             max(s["loaded_s"] for s in r["median_worker_steps"]), r["ttft_s"], r["ratio"], r["paper_s"],
             f"{100 * r['paper_error']:+.0f}%", r["predicted_s"], f"{100 * r['error']:+.0f}%"] for r in summary]
    print(table(f"Cold start to the first token, {model_bytes / 1e9:.2f} GB in {STAGES} stages, "
                f"{args.bandwidth * 8 / 1e9:g} Gbps per server, medians of {args.reps} (s, from placement)",
                ["variant", "process", "imports done", "fetch", "loaded", "TTFT", "× seq", "Eq. 1/5", "error",
                 "with CPU bound", "error"], rows))
    print(f"calibrated: {cal}; tokens {sorted(tokens)}")
    medians = {r["variant"]: r["ttft_s"] for r in summary}
    links = [(args.bandwidth, cal, medians)]
    if slow:  # the same costs; the link measured at the default's ratio of measured to set rate
        links.append((args.slow_bandwidth, dataclasses.replace(cal, bandwidth=cal.bandwidth * args.slow_bandwidth / args.bandwidth),
                      {v.name: statistics.median(t["ttft_s"] for t in slow if t["variant"] == v.name) for v in layouts}))
    for bandwidth, link_cal, ttft in links:
        gbps = f"{bandwidth * 8 / 1e9:g} Gbps"
        choices = layout_choices(link_cal, model_bytes, ttft, cores)
        print(table(f"The layout a waking model gets (Algorithm 1) against each fixed one, {gbps} links, TTFT s",
                    ["objective", "chosen", "predicted", "measured", "met", "whole", "met", "stages", "met"],
                    [[c["objective_s"], c["chosen"], c["predicted_s"], c["measured_s"], c["met"], c["whole_s"],
                      c["whole_met"], c["stages_s"], c["stages_met"]] for c in choices]))
        for c in choices:
            figures += [{"name": f"{gbps} objective {c['objective_s']:.2f} s: chosen layout's TTFT",
                         "value": round(c["measured_s"], 3), "unit": "s", "chosen": c["chosen"],
                         "predicted_s": round(c["predicted_s"], 3), "met": c["met"], "whole_s": round(c["whole_s"], 3),
                         "stages_s": round(c["stages_s"], 3), "reason": c["reason"]}]
        if bandwidth != args.bandwidth:
            figures += [{"name": f"{gbps} {v} TTFT", "value": round(t, 3), "unit": "s",
                         "samples": [round(x["ttft_s"], 3) for x in slow if x["variant"] == v]} for v, t in ttft.items()]
    png = RESULTS / "coldstart.png"
    plot(summary, png)
    path = write("coldstart", figures, conditions(
        model=f"random LLaMA {CONFIG}", model_bytes=int(model_bytes), stages=STAGES, prompt_tokens=len(PROMPT),
        bandwidth_bytes_per_s=args.bandwidth, slow_bandwidth_bytes_per_s=args.slow_bandwidth, reps=args.reps, threads_per_worker=1,
        page_cache="dropped before each trial" if dropped else "warm (left as it was)",
        calibration={**dataclasses.asdict(cal.costs), "bandwidth_bytes_per_s": cal.bandwidth,
                     "load_rate_bytes_per_s": cal.load_rate, "cpu_s_per_gb": cal.cpu_per_byte * 1e9,
                     "cpu_s_per_gb_prefetched": cal.cpu_per_byte_prefetched * 1e9, "cores": cores},
        same_first_token_everywhere=len(tokens) == 1, plot=str(png.relative_to(REPO_ROOT))))
    print(f"wrote {path} and {png}")


if __name__ == "__main__":
    main(sys.argv[1:])
