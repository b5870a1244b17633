"""Containers against processes, on this machine (podman with runc, 2 cores):

- each image's build time with no layer cached (the project's images and their intermediate
  layers removed first; the base image and the wheelhouse kept) and its size;
- scale-up of a SmolLM2 stage replica, from the request to its first work item: a cold process
  (the embedded runtime), a cold container of the stage image (make up-containers), and a
  copy-on-write fork inside the KeysManager's container; interleaved, median of N;
- a CPU-quota change of a running container replica (podman update --cpus): how long the command
  takes (its cgroup holds the new quota when it returns; checked), and a stage pass's time at
  each quota (QUART_THREADS=2)."""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import time
from pathlib import Path

import redis
import torch

from benchmarks.report import SERVING, conditions, scratch, table, write
from benchmarks.scaleup import enqueue_work, first_work_latency, start_cold, stop
from containers import runtime as in_containers
from containers.images import build_images
from containers.launch import remove_stack
from containers.podman import missing, podman
from contracts.config import Settings, load_settings
from contracts.http_client import HttpClient
from contracts.stage import StageRef
from contracts.wire import encode_tensors
from keysmanager.client import KeysClient
from models.manifest import Manifest
from models.partition import ensure_partitioned
from runtime.ports import free_port
from runtime.redis_server import start_redis
from state.store import RedisStore

MEASURES = SERVING + ("containers", "template")  # the code measured (benchmarks/freshness.py)

REPO = Path(__file__).resolve().parent.parent
STAGE = StageRef.parse("smollm2", "1")
IMAGE = "quart/stage:0.1.0"
MODES = ("process, cold", "container, cold", "fork in the KeysManager's container")
QUOTAS = (2.0, 1.0, 0.5, 0.25)


def build_cold(settings: Settings) -> list[dict]:
    for image in ("quart/entry:0.1.0", IMAGE):
        podman(settings, "rmi", "-f", image, check=False)
    podman(settings, "image", "prune", "-f", check=False)  # the dependency stage's layers too
    return build_images(settings, REPO / "stack.yml")


def start_container(settings: Settings, serial: int, out, cpus: float, **env: str) -> tuple[in_containers.ContainerRun, Path]:
    port_file = Path(settings.home) / "run" / "replicas" / f"bench-{serial}.port"
    port_file.unlink(missing_ok=True)
    proc = in_containers.replica(settings, f"quart-bench-{os.getpid()}-{serial}", IMAGE,
                                 {"QUART_MODEL": STAGE.model, "QUART_STAGES": STAGE.stages, **env}, port_file, out, cpus)
    return proc, port_file


def one_start(settings: Settings, km: KeysClient, r: redis.Redis, manifest: Manifest, mode: str, serial: int,
              out) -> float:
    enqueue_work(r, manifest, STAGE.first)
    known = {x.replica_id for x in RedisStore(r).live_replicas(STAGE.model, STAGE.first)}
    t0 = time.time()
    if mode == MODES[0]:
        pid = start_cold(settings, STAGE.model, STAGE.stages, Path(settings.home) / "logs" / "replicas.log")
    elif mode == MODES[1]:
        proc, _ = start_container(settings, serial, out, 1.0)
    else:
        pid = km.fork(STAGE, "smollm2-s1")["pid"]
    _, latency = first_work_latency(r, STAGE.model, STAGE.first, known, t0)
    if mode == MODES[1]:
        proc.terminate()
        proc.wait(timeout=60)
    else:
        stop(r, STAGE.model, STAGE.first, pid)
    return latency * 1000.0


def quota_changes(settings: Settings, manifest: Manifest, out, passes: int) -> list[dict]:
    """A running container replica (2 torch threads) under each quota in turn."""
    proc, port_file = start_container(settings, 999, out, QUOTAS[0], QUART_THREADS="2")
    rows = []
    try:
        deadline = time.monotonic() + 300
        while not port_file.exists():
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("the container replica did not start")
            time.sleep(0.1)
        replica = HttpClient(f"http://127.0.0.1:{int(port_file.read_text())}")
        body = encode_tensors({"hidden": torch.randn(1, 128, manifest.config["hidden_size"])})
        auth = {"Authorization": f"Bearer {settings.internal_api_token()}"}
        replica.request("POST", "/", body, headers=auth)  # warm
        for cpus in QUOTAS:
            t0 = time.perf_counter()
            proc.set_cpus(cpus)  # returns once podman has written the cgroup
            effect_ms = (time.perf_counter() - t0) * 1000
            assert in_containers.cpu_quota(settings, proc.name) == cpus
            times = []
            for _ in range(passes):
                t = time.perf_counter()
                assert replica.request("POST", "/", body, headers=auth).status == 200
                times.append((time.perf_counter() - t) * 1000)
            rows.append({"cpus": cpus, "update_ms": round(effect_ms, 1), "pass_ms": round(statistics.median(times), 1)})
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--no-build", action="store_true", help="use the images there are (no build figures)")
    args = parser.parse_args(argv)
    base = load_settings()
    reason = missing()
    if reason:
        print(f"containers benchmark skipped: {reason}")
        return {}
    ensure_partitioned(base.models_dir, "smollm2", 4)
    builds = [] if args.no_build else build_cold(base)
    with scratch("quart-containers-") as home:
        settings = base.replace(home=str(home), models=str(base.models_dir), redis_port=free_port(),
                                keysmanager_port=free_port(), server="bench", threads=1)
        (home / "logs").mkdir()
        redis_proc = start_redis("127.0.0.1", settings.redis.port, home / "redis", home / "logs" / "redis.log")
        out = open(home / "logs" / "containers.log", "ab")
        km_proc = in_containers.keysmanager(settings, out, IMAGE)
        km, r = KeysClient.for_settings(settings), redis.Redis.from_url(settings.redis_url)
        manifest = Manifest.load(settings.model_dir(STAGE.model))
        samples: dict[str, list[float]] = {m: [] for m in MODES}
        try:
            while not km.healthy():
                if km_proc.poll() is not None:
                    raise RuntimeError(f"the KeysManager's container exited; see {home / 'logs'}")
                time.sleep(0.1)
            km.cache(STAGE)
            km.settled(STAGE)  # no compile beside the starts measured; forks of the compiled zygote
            for i in range(args.repeats):
                for j, mode in enumerate(MODES):
                    samples[mode].append(one_start(settings, km, r, manifest, mode, i * len(MODES) + j, out))
                print(f"scale-up: repetition {i + 1}/{args.repeats} done", flush=True)
            quotas = quota_changes(settings, manifest, out, args.passes)
        finally:
            km_proc.send_signal(signal.SIGTERM)
            km_proc.wait(timeout=60)
            remove_stack(settings, in_containers.label(settings))
            redis_proc.terminate()
            redis_proc.wait()
            out.close()
    return report(builds, samples, quotas, args)


def report(builds: list[dict], samples: dict[str, list[float]], quotas: list[dict], args) -> dict:
    figures = []
    if builds:
        print(table("Images: build with no layer cached (base image and wheelhouse present), size",
                    ["image", "build s", "MB"], [[b["image"], b["build_s"], round(b["bytes"] / 1e6)] for b in builds]))
        for b in builds:
            figures += [{"name": f"build {b['image']}", "value": b["build_s"], "unit": "s"},
                        {"name": f"size {b['image']}", "value": round(b["bytes"] / 1e6, 1), "unit": "MB"}]
    process = statistics.median(samples[MODES[0]])
    rows = []
    for mode in MODES:
        med = statistics.median(samples[mode])
        rows.append([mode, round(med, 1), round(min(samples[mode]), 1), round(process / med, 2)])
        figures += [{"name": f"scale-up smollm2 stage 1, {mode}, median", "value": round(med, 1), "unit": "ms"},
                    {"name": f"scale-up smollm2 stage 1, {mode}, speed-up over a cold process",
                     "value": round(process / med, 2), "unit": "x"}]
    container = statistics.median(samples[MODES[1]])
    fork = statistics.median(samples[MODES[2]])
    figures.append({"name": "cold container over fork in the KeysManager's container", "value": round(container / fork, 1),
                    "unit": "x"})
    print(table(f"Scale-up: request to first work item, median of {args.repeats} (ms)",
                ["start", "median ms", "min ms", "x faster than a cold process"], rows))
    print(table(f"CPU quota of a running container replica (podman update --cpus); stage pass of 128 tokens, "
                f"median of {args.passes}", ["cpus", "podman update ms", "pass ms"],
                [[q["cpus"], q["update_ms"], q["pass_ms"]] for q in quotas]))
    for q in quotas:
        figures += [{"name": f"quota change to {q['cpus']:g} CPUs takes effect", "value": q["update_ms"], "unit": "ms"},
                    {"name": f"stage pass at {q['cpus']:g} CPUs, median", "value": q["pass_ms"], "unit": "ms"}]
    write("containers", figures, conditions(
        repeats=args.repeats, passes=args.passes, runtime="podman 4.3 with runc, host network, cgroup v1",
        stage="smollm2 stage 1 (of 4)", shard_files="in the page cache",
        threads="1 for the scale-up replicas, 2 for the quota runs"))
    return {"samples": samples, "quotas": quotas, "builds": builds}


if __name__ == "__main__":
    main()
