"""QUART's policies scored where they were not tuned. quart-flow, its calm headroom (0.6 while the
entry's CV is at most 4) and the simulator's preset were chosen on the Gamma workload of
`simulator_policies` at seeds 0-4; here every policy runs, in the same simulated testbed (5 models
x 10 req/s each, 12 servers x 4 GPUs), on:

- in sample: Gamma arrivals at CV 4, seeds 0-4 (what the tuning saw);
- out of sample: Gamma at CV 4 on fresh seeds (1000-1004), and two shapes the tuning never saw,
  on the same fresh seeds: bursty spells after BurstGPT (`loadgen.arrivals.bursty_arrivals`: the
  rate 8x higher for heavy-tailed spells of about 8 s among calm ones of about 30 s) and a daily
  cycle after the Azure Functions trace compressed into the run (`diurnal_arrivals`: 4x between
  trough and peak).

Mean latency and goodput (answers within 2x the model's unloaded latency), mean and 95 % interval
over the seeds, and QUART's ratios to the fastest baseline of each workload.

    python -m benchmarks simulator_out_of_sample [--seeds 5] [--duration 600] [--workers 2]"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from autoscaler.policy.controller import POLICIES, VARIANTS
from benchmarks.report import RESULTS, conditions, table, write
from benchmarks.simulator_policies import MEASURES as POLICY_MEASURES
from benchmarks.simulator_policies import RATE, SLO_X, figures_of, simulate_all, style, versus_baselines

MEASURES = POLICY_MEASURES  # the code measured (benchmarks/freshness.py)

FRESH_SEED = 1000
# Label -> (workload, CV, in sample): the columns of the tables.
WORKLOADS = {"gamma cv4 (in sample)": ("gamma", 4.0, True), "gamma cv4, fresh seeds": ("gamma", 4.0, False),
             "bursty, fresh seeds": ("bursty", None, False), "diurnal, fresh seeds": ("diurnal", None, False)}
BURSTY = "bursty, fresh seeds"
CALM = ("quart-flow calm 0.6", "quart-flow", {"calm_utilization": 0.6})  # the tuned headroom as a policy of its own


def jobs(seeds: int, duration: float) -> list[dict]:
    out = []
    for label, (workload, cv, in_sample) in WORKLOADS.items():
        first = 0 if in_sample else FRESH_SEED
        base = {"models": None, "duration": duration, "cv": cv, "workload": workload, "label": label}
        out += [{**base, "policy": p, "seed": first + s} for p in POLICIES for s in range(seeds)]
        out += [{**base, "policy": CALM[1], "params": CALM[2], "seed": first + s} for s in range(seeds)]
    return out


def name(run: dict) -> str:
    return CALM[0] if run.get("params") == CALM[2] else run["policy"]


def rows_of(runs: list[dict]) -> list[dict]:
    names = [*POLICIES, CALM[0]]
    return [{"workload": label, "policy": p, "in_sample": WORKLOADS[label][2],
             **figures_of(mine), **where_bursts_wait(mine)}
            for label in WORKLOADS for p in names
            for mine in [[r for r in runs if r["label"] == label and name(r) == p]]]


def where_bursts_wait(runs: list[dict]) -> dict:
    """A burst's mean wait at the first stage and at the later ones together (ms), averaged over
    the models and seeds that had bursts; empty without any."""
    waits = [m["burst_waits_ms"] for r in runs for m in r["models_out"].values() if m.get("burst_waits_ms")]
    if not waits:
        return {}
    first, later = np.mean(waits, axis=0)
    return {"burst_first_ms": float(first), "burst_later_ms": float(later)}


def ratios_of(rows: list[dict]) -> list[dict]:
    """Per workload and QUART policy: latency and goodput over the workload's best baselines."""
    return [{"workload": label, "in_sample": WORKLOADS[label][2], **r} for label in WORKLOADS
            for r in versus_baselines([r for r in rows if r["workload"] == label], (*VARIANTS, CALM[0]))]


def plot(rows: list[dict]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(dict.fromkeys(r["policy"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(15, 5))
    width = 0.8 / len(names)
    for k, p in enumerate(names):
        mine = [next(r for r in rows if r["workload"] == label and r["policy"] == p) for label in WORKLOADS]
        x = np.arange(len(WORKLOADS)) + (k - len(names) / 2) * width
        colour = style(p if p in POLICIES else "quart-flow")
        if p not in POLICIES:
            colour = {**colour, "color": "black"}
        for ax, figure, ci in ((axes[0], "mean_ms", "mean_ci_ms"), (axes[1], "goodput", "goodput_ci")):
            ax.bar(x, [r[figure] for r in mine], width, yerr=[r[ci] for r in mine], label=p, color=colour["color"],
                   alpha=colour["alpha"], capsize=1.5)
    for ax, title in ((axes[0], "mean latency (ms, log)"), (axes[1], f"goodput (req/s within {SLO_X:g}x unloaded)")):
        ax.set_xticks(np.arange(len(WORKLOADS)), list(WORKLOADS), fontsize=8)
        ax.set_title(f"{title}: in sample and out of sample")
        ax.grid(alpha=0.3, axis="y")
    axes[0].set_yscale("log")
    axes[1].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(RESULTS / "simulator_out_of_sample.png", dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--duration", type=float, default=600.0)
    parser.add_argument("--workers", type=int, default=2)
    a = parser.parse_args(argv or [])
    runs = simulate_all(jobs(a.seeds, a.duration), a.workers)
    rows = rows_of(runs)
    ratios = ratios_of(rows)
    print(table(f"5 models x {RATE:g} req/s, {a.duration:g} s, mean and 95 % interval over {a.seeds} seeds",
                ["workload", "policy", "mean ms", "±", "goodput req/s", "±", "replica-s"],
                [[r["workload"], r["policy"], round(r["mean_ms"]), round(r["mean_ci_ms"]), round(r["goodput"], 2),
                  round(r["goodput_ci"], 2), round(r["replica_s"])] for r in rows]))
    print(table("QUART against the best baseline of each workload (ratios of means; separate: the 95 % intervals "
                "do not overlap)", ["workload", "sample", "policy", "latency ×", "vs", "separate", "goodput ×", "vs",
                                    "separate"],
                [[r["workload"], "in" if r["in_sample"] else "out", r["policy"], round(r["latency_ratio"], 2),
                  r["best_latency_baseline"], r["latency_separate"], round(r["goodput_ratio"], 2), r["best_goodput_baseline"],
                  r["goodput_separate"]] for r in ratios]))
    bursty = [r for r in rows if r["workload"] == BURSTY]
    print(table(f"where a burst waits ({BURSTY}; requests sent while the arrivals ran at 2x the mean rate or more): "
                "mean wait at the first stage and at the later ones together, ms, over models and seeds",
                ["policy", "first stage", "later stages", "mean latency ms"],
                [[r["policy"], round(r["burst_first_ms"]), round(r["burst_later_ms"]), round(r["mean_ms"])]
                 for r in bursty]))
    plot(rows)
    sample = lambda r: "in sample" if r["in_sample"] else "out of sample"  # noqa: E731
    figures = [{"name": f"{r['workload']} {r['policy']} mean latency", "value": round(r["mean_ms"], 1), "unit": "ms",
                "ci95": round(r["mean_ci_ms"], 1), "sample": sample(r)} for r in rows]
    figures += [{"name": f"{r['workload']} {r['policy']} goodput", "value": round(r["goodput"], 3), "unit": "req/s",
                 "ci95": round(r["goodput_ci"], 3), "sample": sample(r)} for r in rows]
    figures += [{"name": f"{r['workload']} {r['policy']} replica-seconds", "value": round(r["replica_s"]), "unit": "s"}
                for r in rows]
    figures += [{"name": f"{r['workload']} {r['policy']} latency / best baseline ({r['best_latency_baseline']})",
                 "value": round(r["latency_ratio"], 3), "unit": "ratio", "separate": r["latency_separate"],
                 "sample": sample(r)} for r in ratios]
    figures += [{"name": f"{r['workload']} {r['policy']} goodput / best baseline ({r['best_goodput_baseline']})",
                 "value": round(r["goodput_ratio"], 3), "unit": "ratio", "separate": r["goodput_separate"],
                 "sample": sample(r)} for r in ratios]
    figures += [{"name": f"{BURSTY} {r['policy']} burst wait at the {where} stage{'s' if where == 'later' else ''}",
                 "value": round(r[f"burst_{where}_ms"], 1), "unit": "ms"} for r in bursty for where in ("first", "later")]
    write("simulator_out_of_sample", figures, conditions(
        seeds=a.seeds, fresh_seeds_from=FRESH_SEED, duration_s=a.duration, rate_per_model_rps=RATE,
        slo=f"{SLO_X:g}x unloaded latency", workloads={k: list(v) for k, v in WORKLOADS.items()},
        tuned_on="Gamma arrivals at seeds 0-4 (simulator_policies): quart-flow, its calm headroom, the preset",
        plot="simulator_out_of_sample.png"))
    return {"rows": rows, "ratios": ratios}


if __name__ == "__main__":
    main(sys.argv[1:])
