"""QUART on a live DAG pipeline, with and without its CV attention, and the simulator on the same
schedules.

EMULATED stages on this 2-core host: ensemble-8 (stack-ensemble.yml: stage 0 fans out to three
branches of two stages that stage 7 joins; LLaMA-7B's time spread over them), Gamma arrivals at
20 req/s and CV 4 for 30 s, one schedule per seed (5), replayed by `python -m loadgen compare`
under QUART and under QUART with QUART_ABLATE=attention (the smoother then reads the observed CVs),
each run on a fresh runtime. Means with 95 % intervals; an effect is claimed only where the
intervals separate. The simulator's embedded preset replays each run's schedule under the same
policy: its mean and p99 against the measured ones.

    python -m benchmarks live_dag
    python -m benchmarks.live_dag [--seeds 5] [--cv 4] [--rate 20] [--duration 30] [--from-runs]"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

from benchmarks.live_policies import simulate_schedule
from benchmarks.report import RESULTS, SERVING, SIMULATOR, conditions, mean_ci95, table, write
from contracts.paths import REPO_ROOT

MEASURES = SERVING + SIMULATOR + ("loadgen", "stack-ensemble.yml", "benchmarks/live_policies.py")  # the code measured (benchmarks/freshness.py)

MODEL = "ensemble-8"
VARIANTS = {"quart": "", "quart without attention": "attention"}  # name -> QUART_ABLATE


def run_dir(seed: int, variant: str, a: argparse.Namespace):
    return RESULTS / f"live-dag-cv{a.cv:g}" / f"seed-{seed}" / ("full" if not VARIANTS[variant] else "no-attention")


def measure(seed: int, variant: str, a: argparse.Namespace) -> dict:
    out = run_dir(seed, variant, a)
    subprocess.run([sys.executable, "-m", "loadgen", "compare", "--stack-file", "stack-ensemble.yml", "--model", MODEL,
                    "--policies", "quart", "--arrivals", "gamma", "--rate", str(a.rate), "--cv", str(a.cv),
                    "--duration", str(a.duration), "--seed", str(seed), "--tail", "15", "--slo-s", "1.0",
                    "--window-s", "5", "--out", str(out), "--no-progress"],
                   cwd=REPO_ROOT, check=True, env={**os.environ, "QUART_ABLATE": VARIANTS[variant]})
    return kept(seed, variant, a)


def kept(seed: int, variant: str, a: argparse.Namespace) -> dict:
    return json.loads((run_dir(seed, variant, a) / "results.json").read_text())["runs"]["quart"]["summary"]


def simulated(seed: int, variant: str, a: argparse.Namespace) -> tuple[float, float]:
    return simulate_schedule(MODEL, "quart", seed, a, ablate=VARIANTS[variant])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--cv", type=float, default=4.0)
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--from-runs", action="store_true", help="the kept runs of benchmarks/results/live-dag-cv<CV>/")
    a = parser.parse_args(argv or [])
    per = {v: {k: [] for k in ("mean", "p99", "goodput", "replica_s", "sim_mean", "sim_p99")} for v in VARIANTS}
    for seed in range(a.seeds):
        for v in VARIANTS:
            s = kept(seed, v, a) if a.from_runs else measure(seed, v, a)
            per[v]["mean"].append(s["latency_s"]["mean"] * 1000)
            per[v]["p99"].append(s["latency_s"]["p99"] * 1000)
            per[v]["goodput"].append(s["goodput"]["requests_per_s"])
            per[v]["replica_s"].append(s["replica_seconds"])
            sim_mean, sim_p99 = simulated(seed, v, a)
            per[v]["sim_mean"].append(sim_mean * 1000)
            per[v]["sim_p99"].append(sim_p99 * 1000)
    rows = [{"variant": v, "mean_ms": mean_ci95(x["mean"]), "p99_ms": mean_ci95(x["p99"]),
             "goodput": mean_ci95(x["goodput"]), "replica_s": float(np.mean(x["replica_s"])),
             "sim_mean_ms": float(np.mean(x["sim_mean"])), "sim_p99_ms": float(np.mean(x["sim_p99"]))}
            for v, x in per.items()]
    for r in rows:
        r["mean_error"], r["p99_error"] = r["sim_mean_ms"] / r["mean_ms"][0] - 1, r["sim_p99_ms"] / r["p99_ms"][0] - 1
    print(table(f"Live, emulated {MODEL} (a DAG), 2 cores: {a.rate:g} req/s, CV {a.cv:g}, {a.duration:g} s, "
                f"mean and 95 % interval over {a.seeds} runs; the simulator on the same schedules",
                ["variant", "mean ms", "±", "p99 ms", "±", "goodput req/s", "±", "replica-s", "sim mean", "error",
                 "sim p99", "error"],
                [[r["variant"], round(r["mean_ms"][0]), round(r["mean_ms"][1]), round(r["p99_ms"][0]),
                  round(r["p99_ms"][1]), round(r["goodput"][0], 2), round(r["goodput"][1], 2), round(r["replica_s"]),
                  round(r["sim_mean_ms"]), f"{100 * r['mean_error']:+.0f} %", round(r["sim_p99_ms"]),
                  f"{100 * r['p99_error']:+.0f} %"] for r in rows]))
    full, ablated = rows
    ratio = full["mean_ms"][0] / ablated["mean_ms"][0]
    separate = abs(full["mean_ms"][0] - ablated["mean_ms"][0]) > full["mean_ms"][1] + ablated["mean_ms"][1]
    print(f"attention's effect: mean latency x{ratio:.2f} ({'separate' if separate else 'within the intervals'})")
    figures = []
    for r in rows:
        v = r["variant"]
        figures += [{"name": f"live dag {v} mean latency", "value": round(r["mean_ms"][0], 1), "unit": "ms",
                     "ci95": round(r["mean_ms"][1], 1), "runs": [round(x, 1) for x in per[v]["mean"]]},
                    {"name": f"live dag {v} p99 latency", "value": round(r["p99_ms"][0], 1), "unit": "ms",
                     "ci95": round(r["p99_ms"][1], 1)},
                    {"name": f"live dag {v} goodput", "value": round(r["goodput"][0], 3), "unit": "req/s",
                     "ci95": round(r["goodput"][1], 3)},
                    {"name": f"live dag {v} replica-seconds", "value": round(r["replica_s"]), "unit": "s"},
                    {"name": f"calibration dag {v} sim mean error", "value": round(r["mean_error"], 4),
                     "unit": "fraction", "sim_ms": round(r["sim_mean_ms"], 1)},
                    {"name": f"calibration dag {v} sim p99 error", "value": round(r["p99_error"], 4),
                     "unit": "fraction", "sim_ms": round(r["sim_p99_ms"], 1)}]
    figures.append({"name": "live dag attention effect on mean latency (with / without)", "value": round(ratio, 3),
                    "unit": "ratio", "intervals_separate": separate})
    write("live_dag", figures, conditions(emulated=True, model=f"{MODEL} (fan-out 3, join at stage 7)", rate_rps=a.rate,
                                          cv=a.cv, duration_s=a.duration, runs=a.seeds, slo_s=1.0, window_s=5.0,
                                          reports=f"benchmarks/results/live-dag-cv{a.cv:g}/seed-*/"))
    return {"rows": rows, "ratio": ratio, "separate": separate}


if __name__ == "__main__":
    main(sys.argv[1:])
