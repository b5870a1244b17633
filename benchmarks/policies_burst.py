"""EMULATED stages: one Gamma-arrival burst (CV 4) replayed against QUART and each baseline in
turn on the embedded runtime, side by side: mean and p99 latency, and replica-seconds (the cost).

The stages are emulated (QUART Table 1's LLaMA-7B profile over 8 stages; compute is a sleep), the
runtime, queues, forks and scaling are real. Every policy gets the same arrival schedule (seed)
and a freshly started runtime; its built-in defaults are used as published."""
from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from autoscaler.policy.controller import POLICIES
from benchmarks.report import SERVING, conditions, scratch, table, write
from contracts.config import load_settings
from loadgen.arrivals import gamma_gaps
from runtime import __main__ as control
from runtime.ports import free_port
from state.store import RedisStore

MEASURES = SERVING + ("loadgen",)  # the code measured (benchmarks/freshness.py)

REPO = Path(__file__).resolve().parent.parent
MODEL, STAGES = "llama-7b", 8



def schedule(rate: float, cv: float, seconds: float, seed: int) -> np.ndarray:
    gaps = gamma_gaps(np.random.default_rng(seed), rate, cv, int(rate * seconds * 3))
    times = np.cumsum(gaps)
    return times[times < seconds]


def replay(url: str, send_at: np.ndarray) -> list[tuple[int, float]]:
    def send() -> tuple[int, float]:
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(urllib.request.Request(url, data=b"{}", method="POST"), timeout=300) as r:
                r.read()
                status = r.status
        except urllib.error.HTTPError as exc:
            status = exc.code
        return status, time.perf_counter() - t0
    start, futures = time.monotonic(), []
    with ThreadPoolExecutor(512) as pool:
        for t in send_at:
            time.sleep(max(0.0, start + t - time.monotonic()))
            futures.append(pool.submit(send))
    return [f.result() for f in futures]


def one_policy(policy: str, send_at: np.ndarray, tail_s: float) -> dict:
    base = load_settings()
    with scratch(f"quart-{policy}-") as home:
        settings = base.replace(home=str(home), models=str(base.models_dir), stack_file=str(REPO / "stack-emulated.yml"),
                                gateway_port=free_port(), redis_port=free_port(), keysmanager_port=free_port(),
                                policy=policy, slo_s=1.0, window_s=5.0,
                                admit_wait_s=0.0)  # the policies alone: every request waits to be served
        if control.up(settings, timeout=600) != 0:
            raise SystemExit(f"the runtime did not come up for {policy}")
        store = RedisStore.from_url(settings.redis_url)
        samples: list[tuple[float, int]] = []
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.5):
                samples.append((time.time(), sum(len(store.live_replicas(MODEL, i)) for i in range(STAGES))))
        sampler = threading.Thread(target=sample, daemon=True)
        try:
            sampler.start()
            results = replay(f"{settings.gateway.url}/function/{MODEL}", send_at)
            time.sleep(tail_s)
        finally:
            stop.set()
            sampler.join()
            control.down(settings)
    latencies = np.array([lat for status, lat in results if status == 200]) * 1000.0
    replica_seconds = sum(n * 0.5 for _, n in samples)
    return {"ok": int(sum(1 for s, _ in results if s == 200)), "sent": len(results),
            "mean_ms": float(latencies.mean()), "p50_ms": float(np.percentile(latencies, 50)),
            "p99_ms": float(np.percentile(latencies, 99)), "replica_seconds": replica_seconds,
            "max_replicas": max(n for _, n in samples)}


def main(rate: float = 20.0, cv: float = 4.0, seconds: float = 30.0, seed: int = 4, tail_s: float = 20.0) -> dict:
    send_at = schedule(rate, cv, seconds, seed)
    results = {}
    for policy in POLICIES:
        print(f"{policy}: replaying {len(send_at)} requests ...", flush=True)
        results[policy] = one_policy(policy, send_at, tail_s)
    rows = [[p, f"{x['ok']}/{x['sent']}", round(x["mean_ms"], 1), round(x["p99_ms"], 1),
             round(x["replica_seconds"], 1), x["max_replicas"]] for p, x in results.items()]
    print(table(f"EMULATED LLaMA-7B (8 stages), Gamma arrivals {rate:g} rps CV {cv:g} for {seconds:g} s",
                ["policy", "ok", "mean ms", "p99 ms", "replica-s", "max replicas"], rows))
    figures = []
    for p, x in results.items():
        figures += [{"name": f"{p} mean latency", "value": round(x["mean_ms"], 2), "unit": "ms"},
                    {"name": f"{p} p99 latency", "value": round(x["p99_ms"], 2), "unit": "ms"},
                    {"name": f"{p} replica-seconds", "value": round(x["replica_seconds"], 1), "unit": "replica-s"},
                    {"name": f"{p} requests ok", "value": x["ok"], "unit": f"of {x['sent']}"},
                    {"name": f"{p} max replicas", "value": x["max_replicas"], "unit": "replicas (all stages)"}]
    write("policies_burst", figures, conditions(
        emulated=True, profile="QUART Table 1 LLaMA-7B, 243 ms over 8 stages, service CV 0.3",
        rate_rps=rate, arrival_cv=cv, seconds=seconds, seed=seed, slo_s=1.0, tick_s=1.0,
        replica_seconds_window=f"burst + {tail_s:g} s"))
    return results


if __name__ == "__main__":
    main()
