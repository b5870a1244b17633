"""QUART live against static and the best baseline, and the simulator calibrated against it.

EMULATED stages on this 2-core host (QUART Table 1's LLaMA-7B split evenly over 8 stages,
stack-emulated.yml): Gamma arrivals at 20 req/s and CV 4 for 30 s, one schedule per seed (5),
replayed by `python -m loadgen compare` against QUART, quart-flow, static and InferLine (the best
baseline in the simulator; its planner given the trace's rate and CV), each run on a fresh
runtime; then quart-flow with headroom while calm (`{"calm_utilization": 0.6}`) on its own.
Means over the 5 runs with their 95 % intervals; a gain is claimed only where the intervals
separate. Then the simulator's embedded preset replays each run's schedule under the
same policy (one simulator seed per run): its mean and p99 against the measured ones (targets:
within 15 % and 25 %).

    python -m benchmarks live_policies
    python -m benchmarks.live_policies [--seeds 5] [--cv 4] [--rate 20] [--duration 30] [--from-runs | --calm]
        (--from-runs: the kept measurements, simulated again: the calibration after a simulator change;
         --calm: only quart-flow with headroom while calm measured again, on the same schedules)"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from benchmarks.report import RESULTS, SERVING, SIMULATOR, conditions, mean_ci95, table, write
from contracts.config import load_settings
from contracts.paths import REPO_ROOT
from loadgen.arrivals import gamma_arrivals
from sim.config import embedded_runtime
from sim.models import table1
from sim.run import simulate

MEASURES = SERVING + SIMULATOR + ("loadgen", "stack-emulated.yml")  # the code measured (benchmarks/freshness.py)

POLICIES = ("quart", "quart-flow", "static", "inferline")
# quart-flow with headroom while calm, run on its own after the others on each schedule.
CALM = "quart-flow calm 0.6"
CALM_PARAMS = {"calm_utilization": 0.6}
MODEL = "llama-7b"


def run_dir(seed: int, a: argparse.Namespace) -> Path:
    return RESULTS / f"live-cv{a.cv:g}" / f"seed-{seed}"


def measure(seed: int, a: argparse.Namespace, calm_only: bool = False) -> dict:
    """Every policy's run on the seed's schedule (`calm_only`: the calm setting's alone, the
    others' kept)."""
    plan = json.dumps({"plan_rps": a.rate, "plan_cv": a.cv})
    if not calm_only:
        compare(seed, a, run_dir(seed, a), POLICIES, f"inferline={plan}")
    compare(seed, a, run_dir(seed, a) / "calm", ["quart-flow"], f"quart-flow={json.dumps(CALM_PARAMS)}")
    return kept(seed, a)


def compare(seed: int, a: argparse.Namespace, out: Path, policies: list[str], params: str) -> None:
    subprocess.run([sys.executable, "-m", "loadgen", "compare", "--stack-file", "stack-emulated.yml", "--model", MODEL,
                    "--policies", ",".join(policies), "--params", params, "--arrivals", "gamma",
                    "--rate", str(a.rate), "--cv", str(a.cv), "--duration", str(a.duration), "--seed", str(seed),
                    "--tail", "15", "--slo-s", "1.0", "--window-s", "5", "--out", str(out), "--no-progress"],
                   cwd=REPO_ROOT, check=True)


def kept(seed: int, a: argparse.Namespace) -> dict:
    """The seed's runs by policy, the calm setting's under CALM."""
    runs = json.loads((run_dir(seed, a) / "results.json").read_text())["runs"]
    calm = run_dir(seed, a) / "calm" / "results.json"
    return {**runs, CALM: json.loads(calm.read_text())["runs"]["quart-flow"]} if calm.exists() else runs


def simulated(seed: int, label: str, a: argparse.Namespace) -> tuple[float, float]:
    if label == CALM:
        return simulate_schedule(MODEL, "quart-flow", seed, a, policy_params=CALM_PARAMS)
    params = {"plan_rps": a.rate, "plan_cv": a.cv} if label == "inferline" else {}
    return simulate_schedule(MODEL, label, seed, a, policy_params=params)


def simulate_schedule(model: str, policy: str, seed: int, a: argparse.Namespace, **settings: object) -> tuple[float, float]:
    """(mean, p99) in seconds of the simulator's embedded preset on a live run's schedule (the
    run's seed, rate, CV and duration), the policy given `settings` by short name."""
    arrivals = {model: gamma_arrivals(a.rate, a.cv, a.duration, seed=seed)}
    trace = simulate(embedded_runtime(seed=seed), table1([model]), arrivals, policy,
                     load_settings(environ={}, home="/nonexistent-quart-home", **settings))
    lat = trace.latency[trace.status == 200]
    return float(lat.mean()), float(np.percentile(lat, 99))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--cv", type=float, default=4.0)
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--duration", type=float, default=30.0)
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--from-runs", action="store_true",
                      help="the measured runs kept in benchmarks/results/live-cv<CV>/seed-*/ (simulate only)")
    only.add_argument("--calm", action="store_true", help=f"measure only {CALM} (quart-flow {json.dumps(CALM_PARAMS)}), "
                      "the other policies' runs kept")
    a = parser.parse_args(argv or [])
    runs = {seed: kept(seed, a) if a.from_runs else measure(seed, a, a.calm) for seed in range(a.seeds)}
    labels = [p for p in (*POLICIES, CALM) if all(p in r for r in runs.values())]
    rows, figures = [], []
    per = {p: {k: [] for k in ("mean", "p99", "goodput", "attain", "sim_mean", "sim_p99", "replica_s")} for p in labels}
    for seed, by_policy in runs.items():
        for p in labels:
            s = by_policy[p]["summary"]
            per[p]["mean"].append(s["latency_s"]["mean"] * 1000)
            per[p]["p99"].append(s["latency_s"]["p99"] * 1000)
            per[p]["goodput"].append(s["goodput"]["requests_per_s"])
            per[p]["attain"].append(s["slo_attainment"]["2"])
            per[p]["replica_s"].append(s["replica_seconds"])
            sim_mean, sim_p99 = simulated(seed, p, a)
            per[p]["sim_mean"].append(sim_mean * 1000)
            per[p]["sim_p99"].append(sim_p99 * 1000)
    for p in labels:
        m, p99, good = mean_ci95(per[p]["mean"]), mean_ci95(per[p]["p99"]), mean_ci95(per[p]["goodput"])
        sim_m, sim_p99 = float(np.mean(per[p]["sim_mean"])), float(np.mean(per[p]["sim_p99"]))
        rows.append({"policy": p, "mean_ms": m, "p99_ms": p99, "goodput": good,
                     "attainment_2x": float(np.mean(per[p]["attain"])), "replica_s": float(np.mean(per[p]["replica_s"])),
                     "sim_mean_ms": sim_m, "sim_p99_ms": sim_p99,
                     "mean_error": sim_m / m[0] - 1, "p99_error": sim_p99 / p99[0] - 1})
    print(table(f"Live, emulated LLaMA-7B (even split), 2 cores: {a.rate:g} req/s, CV {a.cv:g}, {a.duration:g} s, "
                f"mean and 95 % interval over {a.seeds} runs",
                ["policy", "mean ms", "±", "p99 ms", "±", "goodput req/s", "±", "SLO 2x", "replica-s"],
                [[r["policy"], round(r["mean_ms"][0]), round(r["mean_ms"][1]), round(r["p99_ms"][0]), round(r["p99_ms"][1]),
                  round(r["goodput"][0], 2), round(r["goodput"][1], 2), f"{100 * r['attainment_2x']:.1f} %",
                  round(r["replica_s"])] for r in rows]))
    gains = []
    by = {r["policy"]: r for r in rows}
    for mine in (p for p in labels if p.startswith("quart")):
        for other in ("static", "inferline"):
            x, y = by[mine]["mean_ms"], by[other]["mean_ms"]
            gains.append({"policy": mine, "against": other, "latency_ratio": x[0] / y[0],
                          "separate": abs(x[0] - y[0]) > x[1] + y[1]})
    print(table("Gains (mean latency ratio; claimed only where the 95 % intervals separate)",
                ["policy", "against", "latency ×", "intervals separate"],
                [[g["policy"], g["against"], round(g["latency_ratio"], 2), g["separate"]] for g in gains]))
    print(table("Simulator calibration: embedded preset on each run's schedule, mean over the runs",
                ["policy", "real mean", "sim mean", "error", "real p99", "sim p99", "error"],
                [[r["policy"], round(r["mean_ms"][0]), round(r["sim_mean_ms"]), f"{100 * r['mean_error']:+.0f} %",
                  round(r["p99_ms"][0]), round(r["sim_p99_ms"]), f"{100 * r['p99_error']:+.0f} %"] for r in rows]))
    for r in rows:
        p = r["policy"]
        figures += [{"name": f"live {p} mean latency", "value": round(r["mean_ms"][0], 1), "unit": "ms",
                     "ci95": round(r["mean_ms"][1], 1), "runs": [round(x, 1) for x in per[p]["mean"]]},
                    {"name": f"live {p} p99 latency", "value": round(r["p99_ms"][0], 1), "unit": "ms",
                     "ci95": round(r["p99_ms"][1], 1)},
                    {"name": f"live {p} goodput", "value": round(r["goodput"][0], 3), "unit": "req/s",
                     "ci95": round(r["goodput"][1], 3)},
                    {"name": f"live {p} SLO attainment at 2x", "value": round(r["attainment_2x"], 4), "unit": "fraction"},
                    {"name": f"live {p} replica-seconds", "value": round(r["replica_s"]), "unit": "s"},
                    {"name": f"calibration {p} sim mean error", "value": round(r["mean_error"], 4), "unit": "fraction",
                     "sim_ms": round(r["sim_mean_ms"], 1)},
                    {"name": f"calibration {p} sim p99 error", "value": round(r["p99_error"], 4), "unit": "fraction",
                     "sim_ms": round(r["sim_p99_ms"], 1)}]
    figures += [{"name": f"live {g['policy']} / {g['against']} mean latency", "value": round(g["latency_ratio"], 3),
                 "unit": "ratio", "intervals_separate": g["separate"]} for g in gains]
    write("live_policies", figures, conditions(emulated=True, model=f"{MODEL} (even split, 8 stages)", rate_rps=a.rate,
                                               cv=a.cv, duration_s=a.duration, runs=a.seeds, slo_s=1.0, window_s=5.0,
                                               reports=f"benchmarks/results/live-cv{a.cv:g}/seed-*/"))
    return {"rows": rows, "gains": gains}


if __name__ == "__main__":
    main(sys.argv[1:])
