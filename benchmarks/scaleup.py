"""Scale-up latency of a stage replica, from the request to add it until it has taken its first
work item, for a cold start (new process, imports, shard load), a copy-on-write fork from a
KeysManager zygote, and a non-COW fork (parameters cloned); for a SmolLM2 stage shard and a
random-weight stage of about 1 GB. Interleaved, side by side in one run. Then the proportional
set size (PSS) of 1, 4 and 8 COW children against one cold replica.

A work item waits in the stage's stream before each start, so "first work" is the replica's first
XREADGROUP that returns it; the replica records that moment in its registration."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import redis
import torch

from benchmarks.report import SERVING, conditions, mean_ci95, scratch, table, verdict, write
from contracts.config import Settings, child_environment, load_settings
from contracts.paths import STAGE_HANDLER
from contracts.stage import StageRef
from contracts.wire import MESSAGE_FIELD, Header, pack
from keysmanager.client import KeysClient
from models.manifest import Manifest
from runtime.functions import start_watchdog
from runtime.ports import free_port
from runtime.redis_server import start_redis
from state import keys
from state.store import RedisStore

MEASURES = SERVING  # the code measured (benchmarks/freshness.py)

REPO = Path(__file__).resolve().parent.parent
RANDOM_1G = {"hidden_size": 2048, "num_hidden_layers": 15, "intermediate_size": 5632,
             "num_attention_heads": 16, "num_key_value_heads": 16}
CASES = [("smollm2", "1"), ("random-1g", "1")]
MODES = ("cold", "fork-cow", "fork-copy")
# A forked replica, compiled steps included, first-works within this (ms): what the fork cache promises.
FORK_TARGET_MS = 150.0
# Replicas allocate a little while they start (threads, the HTTP app): measured once settled.
SETTLE_S = 2.0


def ensure_models(settings: Settings) -> None:
    from models.partition import ensure_partitioned
    ensure_partitioned(settings.models_dir, "smollm2", 4)
    ensure_partitioned(settings.models_dir, "random-1g", 3, "random-llama", "uniform", RANDOM_1G)


def enqueue_work(r: redis.Redis, manifest: Manifest, stage: int) -> None:
    width = manifest.config["hidden_size"]
    header = Header(request_id=f"bench-{time.time_ns()}", model=manifest.model, stage=stage,
                    reply_to="quart:bench:replies", deadline=time.time() + 600)
    r.xadd(keys.stage_stream(manifest.model, stage), {MESSAGE_FIELD: pack(header, {"hidden": torch.randn(1, 8, width)})})


def start_cold(settings: Settings, model: str, stages: str, log: Path) -> int:
    return start_watchdog(settings, STAGE_HANDLER, {"QUART_MODEL": model, "QUART_STAGES": stages}, None, log).pid


def first_work_latency(r: redis.Redis, model: str, stage: int, known: set[str], t0: float) -> tuple[str, float]:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        for rep in RedisStore(r).live_replicas(model, stage):
            if rep.replica_id not in known and rep.first_work_at is not None:
                return rep.replica_id, rep.first_work_at - t0
        time.sleep(0.002)
    raise TimeoutError(f"no new replica of {model} stage {stage} took work")


def stop(r: redis.Redis, model: str, stage: int, pid: int) -> None:
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(x.pid == pid for x in RedisStore(r).live_replicas(model, stage)):
        time.sleep(0.05)
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def one_start(settings: Settings, client: KeysClient, r: redis.Redis, manifest: Manifest, stages: str,
              mode: str, log: Path) -> float:
    stage = int(stages)
    enqueue_work(r, manifest, stage)
    known = {x.replica_id for x in RedisStore(r).live_replicas(manifest.model, stage)}
    t0 = time.time()
    if mode == "cold":
        pid = start_cold(settings, manifest.model, stages, log)
    else:
        pid = client.fork(StageRef.parse(manifest.model, stages), f"{manifest.model}-s{stages}", cow=mode == "fork-cow")["pid"]
    _, latency = first_work_latency(r, manifest.model, stage, known, t0)
    stop(r, manifest.model, stage, pid)
    return latency * 1000.0


def pss(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))


def measure_pss(settings: Settings, client: KeysClient, r: redis.Redis, model: str, stages: str, log: Path) -> dict:
    stage = int(stages)
    zygote = client.cache(StageRef.parse(model, stages))
    out: dict[str, float] = {}
    cold_pid = start_cold(settings, model, stages, log)
    wait_registered(r, model, stage, 1)
    time.sleep(SETTLE_S)
    out["cold replica"] = pss(cold_pid) / 1e6
    stop(r, model, stage, cold_pid)
    for n in (1, 4, 8):
        pids = [client.fork(StageRef.parse(model, stages), f"{model}-s{stages}")["pid"] for _ in range(n)]
        wait_registered(r, model, stage, n)
        time.sleep(SETTLE_S)
        total = (sum(pss(p) for p in pids) + pss(zygote["pid"])) / 1e6
        out[f"{n} COW children + zygote"] = total
        if n > 1:
            out[f"each COW child beyond the first ({n} children)"] = (total - out["1 COW children + zygote"]) / (n - 1)
        for pid in pids:
            stop(r, model, stage, pid)
    return out


def wait_registered(r: redis.Redis, model: str, stage: int, n: int) -> None:
    deadline = time.monotonic() + 300
    while len(RedisStore(r).live_replicas(model, stage)) < n:
        if time.monotonic() > deadline:
            raise TimeoutError("replicas did not register")
        time.sleep(0.05)


def main(repeats: int = 5) -> dict:
    base = load_settings()
    ensure_models(base)
    with scratch("quart-scaleup-") as home:
        settings = base.replace(home=str(home), models=str(base.models_dir), redis_port=free_port(),
                                keysmanager_port=free_port(), server="bench", threads=1)
        (home / "logs").mkdir()
        log = home / "logs" / "replicas.log"
        redis_proc = start_redis("127.0.0.1", settings.redis.port, home / "redis", home / "logs" / "redis.log")
        env = child_environment(settings)
        km = subprocess.Popen([sys.executable, "-m", "keysmanager"], env=env, cwd=REPO,
                              stdout=open(home / "logs" / "keysmanager.log", "ab"), stderr=subprocess.STDOUT)
        client = KeysClient.for_settings(settings)
        r = redis.Redis.from_url(settings.redis_url)
        try:
            while not client.healthy():
                time.sleep(0.1)
            samples: dict[tuple[str, str], list[float]] = {}
            for model, stages in CASES:
                manifest = Manifest.load(settings.model_dir(model))
                client.cache(StageRef.parse(model, stages))
                client.settled(StageRef.parse(model, stages))  # forks of the compiled zygote
                for i in range(repeats):
                    for mode in MODES:
                        samples.setdefault((model, mode), []).append(
                            one_start(settings, client, r, manifest, stages, mode, log))
                    print(f"{model}: repetition {i + 1}/{repeats} done", flush=True)
            memory = measure_pss(settings, client, r, "smollm2", "1", log)
        finally:
            km.terminate()
            km.wait(timeout=60)
            redis_proc.terminate()
            redis_proc.wait()
    return report(settings, samples, memory, repeats)


def report(settings: Settings, samples: dict, memory: dict, repeats: int) -> dict:
    rows, figures = [], []
    for model, stages in CASES:
        shard = Manifest.load(settings.model_dir(model)).stages[int(stages)].bytes / 1e6
        cold = float(np.median(samples[(model, "cold")]))
        for mode in MODES:
            med = float(np.median(samples[(model, mode)]))
            rows.append([f"{model} s{stages} ({shard:.0f} MB)", mode, round(med, 1),
                         round(min(samples[(model, mode)]), 1), round(cold / med, 1)])
            figures.append({"name": f"scale-up {model} stage {stages} {mode} median", "value": round(med, 2),
                            "unit": "ms", "shard_mb": round(shard, 1)})
            figures.append({"name": f"speed-up over cold {model} stage {stages} {mode}",
                            "value": round(cold / med, 2), "unit": "x"})
            if mode == "fork-cow":  # the figure with a target, so its interval says whether it is met
                mean, half = mean_ci95(samples[(model, mode)])
                figures.append({"name": f"scale-up {model} stage {stages} fork-cow mean", "value": round(mean, 2),
                                "unit": "ms", "ci95": [round(mean - half, 2), round(mean + half, 2)],
                                "target": FORK_TARGET_MS, "verdict": verdict(mean, half, FORK_TARGET_MS)})
    print(table(f"Scale-up: request to first work item, median of {repeats} (ms)",
                ["stage", "start", "median ms", "min ms", "x faster than cold"], rows))
    print(table("PSS of smollm2 stage 1 replicas (MB)", ["what", "PSS MB"],
                [[k, round(v, 1)] for k, v in memory.items()]))
    figures += [{"name": f"PSS {k}", "value": round(v, 1), "unit": "MB"} for k, v in memory.items()]
    # QUART_COMPILE=true: the zygotes compile the decode step before they fork (a fork inherits it).
    compiles = settings.compute.compiles
    write("scaleup_compiled" if compiles else "scaleup", figures,
          conditions(repeats=repeats, device="cpu", threads=1, compiled_decode_steps=compiles,
                     shard_files="in the page cache (a cold start from disk is slower)"))
    return {"samples": {f"{m}/{k}": v for (m, k), v in samples.items()}, "pss_mb": memory}


if __name__ == "__main__":
    main()
