"""QUART's evaluation in the cluster simulator, at its testbed (12 servers x 4 GPUs, 1 TB each),
with Table 1's 5 models split evenly over 8 stages, every mechanism on (the shipped CV-attention
model; CPU fits of the simulated service law), 5 seeds per point:

1. Fig. 6/7: all 5 models together at 10 req/s each, entry CV 0.1-8, every policy: mean latency
   (averaged over the models) and goodput (answers within 2x the model's unloaded latency, the
   latency objective every policy is given), mean and 95 % interval over the seeds; the ratio of
   QUART and quart-flow to the best baseline at each CV; SLO attainment at 1-3x per model at CV 4.
   InferLine's planner is given the trace's rate and CV as its planning sample.
2. Fig. 8: at CV 4 and 8, latency quantiles per policy and the mean queue per stage (LLaMA-7B).
3. Ablation: QUART and quart-flow minus each mechanism (QUART_ABLATE) at CV 4 and 8.
4. The DAG: the fan-out/fan-in ensemble alone at CV 4 and 8, QUART with and without attention.
5. Headroom: quart-flow sizing stages for a lower utilization (`target_utilization` always, or
   `calm_utilization` while the entry's CV is calm), every CV: the latency each buys and its
   cost in replica-seconds, against the fastest baseline.

    python -m benchmarks.simulator_policies [--seeds 5] [--duration 600]
    python -m benchmarks.simulator_policies --from-runs     tables and plots again from the kept runs
    python -m benchmarks.simulator_policies --redo dag      the same, the DAG's runs simulated again
    python -m benchmarks.simulator_policies --redo headroom the same, the headroom runs simulated again"""
from __future__ import annotations

import argparse
import json
import sys
from multiprocessing import get_context

import numpy as np
import torch

from autoscaler.policy.baselines import BASELINES
from autoscaler.policy.controller import POLICIES, VARIANTS
from benchmarks.report import RESULTS, SIMULATOR, conditions, mean_ci95, table, write
from contracts import artefacts
from contracts.config import MECHANISMS, load_settings
from loadgen.arrivals import bursty_arrivals, diurnal_arrivals, gamma_arrivals, in_burst
from sim.config import quart_testbed
from sim.models import table1
from sim.run import replica_seconds, simulate, unloaded_latency

MEASURES = SIMULATOR + ("autoscaler", "loadgen", "contracts")  # the code measured (benchmarks/freshness.py)

CVS = (0.1, 1.0, 2.0, 4.0, 8.0)
RATE = 10.0
SLO_X = 2.0
# The multiples of each model's unloaded latency that Fig. 6b reads attainment at.
SLO_MULTIPLES = (1.0, 1.5, 2.0, 2.5, 3.0)
# quart-flow's settings besides its defaults in the headroom section: its parameters by label.
HEADROOM = {"u 0.6": {"target_utilization": 0.6}, "u 0.3": {"target_utilization": 0.3},
            "calm 0.6": {"calm_utilization": 0.6}}


# Each model's arrivals by the job's workload: Gamma at the job's CV (what the policies were tuned
# on), or a generated shape (benchmarks/simulator_out_of_sample.py scores them on those).
WORKLOADS = {"gamma": lambda cv, duration, seed: gamma_arrivals(RATE, cv, duration, seed),
             "bursty": lambda cv, duration, seed: bursty_arrivals(RATE, duration, seed),
             "diurnal": lambda cv, duration, seed: diurnal_arrivals(RATE, duration, seed)}


def run_one(job: dict) -> dict:
    """One simulated run: every model's latency figures, goodput and queue per stage."""
    torch.set_num_threads(1)
    models = table1(job["models"])
    cfg = quart_testbed(seed=job["seed"], slo_x=SLO_X)
    workload = WORKLOADS[job.get("workload", "gamma")]
    arrivals = {m.name: workload(job["cv"], job["duration"], 100 * job["seed"] + k) for k, m in enumerate(models)}
    # InferLine plans from a sample of the trace: its rate and CV (a generated shape's, as measured).
    plan_cv = job["cv"] if job["cv"] is not None else float(np.mean([gaps_cv(a) for a in arrivals.values()]))
    params = job.get("params") or ({"plan_rps": RATE, "plan_cv": plan_cv} if job["policy"] == "inferline" else {})
    settings = load_settings(environ={}, home="/nonexistent-quart-home", policy_params=params,
                             ablate=job.get("ablate", ""))
    trace = simulate(cfg, models, arrivals, job["policy"], settings, record_arrivals=False)
    out = {**job, "models_out": {}, "replica_s": replica_seconds(trace, cfg.sample_s), "forks": trace.starts["fork"],
           "cold": trace.starts["cold"]}
    for k, m in enumerate(models):
        mine = trace.model_of == k
        ok = mine & (trace.status == 200)
        unloaded = unloaded_latency(cfg, m)
        lat = trace.latency[ok]
        out["models_out"][m.name] = {
            "mean_ms": float(lat.mean()) * 1000, "sent": int(mine.sum()), "failed": int((mine & ~ok).sum()),
            "quantiles_ms": [float(np.percentile(lat, q)) * 1000 for q in (50, 75, 90, 99)],
            "goodput": float((ok & (trace.latency <= SLO_X * unloaded)).sum()) / job["duration"],
            "attainment": [float((ok & (trace.latency <= x * unloaded)).sum()) / max(1, int(mine.sum()))
                           for x in SLO_MULTIPLES],
            "queue": np.asarray(trace.samples[m.name]["queue"], dtype=float).mean(axis=0).round(3).tolist(),
            "burst_waits_ms": burst_waits(trace.wait[mine], trace.sent[mine], arrivals[m.name])}
    return out


def burst_waits(wait: np.ndarray, sent: np.ndarray, arrivals: np.ndarray) -> list[float] | None:
    """Of the requests sent in a burst (loadgen.arrivals.in_burst): their mean wait at the first
    stage and summed over the later ones, ms (where a burst waits: at the entry only, or at each
    stage in turn); None without a burst."""
    burst = in_burst(arrivals, sent, RATE)
    if not burst.any():
        return None
    per_stage = np.nanmean(wait[burst], axis=0) * 1000.0
    return [round(float(per_stage[0]), 2), round(float(per_stage[1:].sum()), 2)]


def gaps_cv(times: np.ndarray) -> float:
    gaps = np.diff(times)
    return float(gaps.std() / gaps.mean())


def summary(run: dict) -> tuple[float, float]:
    """(mean latency averaged over the models, goodput summed over them)."""
    per = run["models_out"].values()
    return float(np.mean([m["mean_ms"] for m in per])), float(sum(m["goodput"] for m in per))


def select(runs: list[dict], cv: float, policy: str, ablate: str = "", models: list[str] | None = None,
           params: dict | None = None) -> list[dict]:
    """The runs at `cv` under `policy` without `ablate` (""; every mechanism on) of `models`
    (None: all 5 together) with the policy parameters `params` (None: its defaults)."""
    return [r for r in runs if r["cv"] == cv and r["policy"] == policy and r.get("ablate", "") == ablate
            and r["models"] == models and r.get("params") == params]


def fig7_rows(runs: list[dict]) -> list[dict]:
    return [{"cv": cv, "policy": policy, **figures_of(select(runs, cv, policy))} for cv in CVS for policy in POLICIES]


def figures_of(runs: list[dict]) -> dict:
    """Mean latency and goodput over the seeds' runs with their 95 % intervals, and mean replica-seconds."""
    lat, good = mean_ci95([summary(r)[0] for r in runs]), mean_ci95([summary(r)[1] for r in runs])
    return {"mean_ms": lat[0], "mean_ci_ms": lat[1], "goodput": good[0], "goodput_ci": good[1],
            "replica_s": float(np.mean([r["replica_s"] for r in runs]))}


def separate(a: dict, b: dict, figure: str, ci: str) -> bool:
    """Whether two rows' 95 % intervals of `figure` do not overlap."""
    return abs(a[figure] - b[figure]) > a[ci] + b[ci]


def fastest_baseline(rows: list[dict], cv: float) -> dict:
    return min((r for r in rows if r["cv"] == cv and r["policy"] in BASELINES), key=lambda r: r["mean_ms"])


def against_best(rows: list[dict]) -> list[dict]:
    """Per CV and QUART policy: its latency and goodput over the best baseline's, and whether the
    seeds' intervals separate."""
    return [{"cv": cv, **r} for cv in CVS for r in versus_baselines([r for r in rows if r["cv"] == cv], VARIANTS)]


def versus_baselines(group: list[dict], policies) -> list[dict]:
    """Each of `policies`' rows in `group` (one workload's rows) against the group's best baselines
    (lowest mean latency; highest goodput): the ratios, and whether the seeds' 95 % intervals separate."""
    baselines = [r for r in group if r["policy"] in BASELINES]
    fastest = min(baselines, key=lambda r: r["mean_ms"])
    best_good = max(baselines, key=lambda r: r["goodput"])
    return [{"policy": r["policy"], "best_latency_baseline": fastest["policy"],
             "latency_ratio": r["mean_ms"] / fastest["mean_ms"],
             "latency_separate": separate(r, fastest, "mean_ms", "mean_ci_ms"),
             "best_goodput_baseline": best_good["policy"], "goodput_ratio": r["goodput"] / best_good["goodput"],
             "goodput_separate": separate(r, best_good, "goodput", "goodput_ci")}
            for r in group if r["policy"] in policies]


def ablation_rows(runs: list[dict]) -> list[dict]:
    return [{"policy": policy, "cv": cv, "without": ablate or "(full)", **figures_of(mine)}
            for policy in VARIANTS for cv in (4.0, 8.0) for ablate in ("", *MECHANISMS)
            if (mine := select(runs, cv, policy, ablate))]


def dag_rows(runs: list[dict]) -> list[dict]:
    rows = []
    for cv in (4.0, 8.0):
        for ablate in ("", "attention"):
            mine = select(runs, cv, "quart", ablate, ["ensemble-8"])
            lat = mean_ci95([r["models_out"]["ensemble-8"]["mean_ms"] for r in mine])
            good = mean_ci95([r["models_out"]["ensemble-8"]["goodput"] for r in mine])
            rows.append({"cv": cv, "attention": not ablate, "mean_ms": lat[0], "mean_ci_ms": lat[1],
                         "goodput": good[0], "goodput_ci": good[1],
                         "replica_s": float(np.mean([r["replica_s"] for r in mine]))})
    return rows


def headroom_rows(runs: list[dict], rows: list[dict]) -> list[dict]:
    """quart-flow in each setting beside the fastest baseline (of the Fig. 7 `rows`), per CV:
    latency, goodput and cost, and the latency over the fastest baseline's (separate: the 95 %
    intervals do not overlap)."""
    out = []
    for cv in CVS:
        fastest = fastest_baseline(rows, cv)
        mine = [fastest, next(r for r in rows if r["cv"] == cv and r["policy"] == "quart-flow")]
        mine += [{"cv": cv, "policy": f"quart-flow {label}", **figures_of(select(runs, cv, "quart-flow", params=params))}
                 for label, params in HEADROOM.items()]
        out += [{**r, "latency_ratio": r["mean_ms"] / fastest["mean_ms"],
                 "separate": separate(r, fastest, "mean_ms", "mean_ci_ms")} for r in mine]
    return out


def jobs(seeds: int, duration: float) -> list[dict]:
    base = {"models": None, "duration": duration}
    out = [{**base, "cv": cv, "policy": p, "seed": s} for cv in CVS for p in POLICIES for s in range(seeds)]
    out += [{**base, "cv": cv, "policy": p, "seed": s, "ablate": m}
            for p in VARIANTS for cv in (4.0, 8.0) for m in MECHANISMS for s in range(seeds)]
    out += [{**base, "models": ["ensemble-8"], "cv": cv, "policy": "quart", "seed": s, "ablate": a}
            for cv in (4.0, 8.0) for a in ("", "attention") for s in range(seeds)]
    out += [{**base, "cv": cv, "policy": "quart-flow", "seed": s, "params": params}
            for cv in CVS for params in HEADROOM.values() for s in range(seeds)]
    return out


# The sections --redo simulates again, each by the jobs that make it.
SECTIONS = {"dag": lambda job: job.get("models") == ["ensemble-8"], "headroom": lambda job: "params" in job}


def simulate_all(todo: list[dict], workers: int) -> list[dict]:
    runs = []
    with get_context("fork").Pool(workers) as pool:
        for k, run in enumerate(pool.imap_unordered(run_one, todo), 1):
            runs.append(run)
            if k % 20 == 0 or k == len(todo):
                print(f"  {k}/{len(todo)} simulated runs", flush=True)
    return runs


def style(policy: str) -> dict:
    """One colour per policy (12 of them: the default cycle has 10), QUART's variants bold."""
    import matplotlib
    colour = matplotlib.colormaps["tab20"](POLICIES.index(policy) / 20)
    bold = policy in VARIANTS
    return {"color": colour, "linewidth": 2.5 if bold else 1.0, "alpha": 1.0 if bold else 0.8}


def plot(rows: list[dict], runs: list[dict]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(14, 5))
    for policy in POLICIES:
        mine = [r for r in rows if r["policy"] == policy]
        a.errorbar(CVS, [r["mean_ms"] for r in mine], yerr=[r["mean_ci_ms"] for r in mine], marker="o",
                   label=policy, capsize=3, **style(policy))
        b.errorbar(CVS, [r["goodput"] for r in mine], yerr=[r["goodput_ci"] for r in mine], marker="o",
                   label=policy, capsize=3, **style(policy))
    a.set(title="Fig. 7a (simulated): mean latency, 5 models, 95 % interval over seeds", xlabel="entry CV",
          ylabel="ms", xscale="log", yscale="log")
    b.set(title="Fig. 7b (simulated): goodput (within 2x unloaded), 5 models", xlabel="entry CV",
          ylabel="req/s", xscale="log")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / "simulator_fig7.png", dpi=100)
    plt.close(fig)
    fig, axes = plt.subplots(2, 2, figsize=(14, 8), squeeze=False)
    for col, cv in enumerate(cv for cv in (4.0, 8.0) if cv in CVS):
        for policy in POLICIES:
            mine = [r["models_out"]["llama-7b"] for r in select(runs, cv, policy)]
            q = np.mean([m["quantiles_ms"] for m in mine], axis=0)
            axes[0][col].plot(["p50", "p75", "p90", "p99"], q, marker="o", label=policy, **style(policy))
            axes[1][col].plot(range(8), np.mean([m["queue"] for m in mine], axis=0), marker="o", label=policy,
                              **style(policy))
        axes[0][col].set(title=f"Fig. 8a (simulated): LLaMA-7B latency quantiles, CV {cv:g}", ylabel="ms", yscale="log")
        axes[1][col].set(title=f"Fig. 8b (simulated): LLaMA-7B mean queue per stage, CV {cv:g}", xlabel="stage",
                         yscale="symlog")
        for ax in axes[:, col]:
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(RESULTS / "simulator_fig8.png", dpi=100)
    plt.close(fig)


def plot_headroom(rows: list[dict], headroom: list[dict]) -> None:
    """Latency against cost per CV: every policy, and quart-flow in each headroom setting."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(CVS), figsize=(4 * len(CVS), 4))
    for ax, cv in zip(axes, CVS):
        for r in (r for r in rows if r["cv"] == cv):
            ax.errorbar(r["replica_s"], r["mean_ms"], yerr=r["mean_ci_ms"], marker="o", label=r["policy"],
                        capsize=2, linestyle="none", **style(r["policy"]))
        for r in (r for r in headroom if r["cv"] == cv and r["policy"].startswith("quart-flow ")):
            ax.errorbar(r["replica_s"], r["mean_ms"], yerr=r["mean_ci_ms"], marker="s", capsize=2, linestyle="none",
                        label=r["policy"], color="black", alpha=1.0 if "calm" in r["policy"] else 0.4)
        ax.set(title=f"CV {cv:g}", xlabel="replica-seconds", ylabel="mean ms", xscale="log", yscale="log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=6)
    fig.suptitle("Latency against cost (simulated, 5 models x 10 req/s); black squares: quart-flow with headroom")
    fig.tight_layout()
    fig.savefig(RESULTS / "simulator_headroom.png", dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--duration", type=float, default=600.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--from-runs", action="store_true",
                        help="tables, plots and results from the kept runs (simulator_policies_runs.json), not simulating")
    parser.add_argument("--redo", choices=sorted(SECTIONS), help="the kept runs, this section's simulated again")
    a = parser.parse_args(argv or [])
    kept = RESULTS / "simulator_policies_runs.json"
    if a.from_runs or a.redo:
        runs = json.loads(kept.read_text())
        if a.redo:
            redo = SECTIONS[a.redo]
            runs = [r for r in runs if not redo(r)] + simulate_all(
                [j for j in jobs(a.seeds, a.duration) if redo(j)], a.workers)
    else:
        runs = simulate_all(jobs(a.seeds, a.duration), a.workers)
    if not a.from_runs:
        # Every run's figures, so the tables can be read again without simulating.
        kept.write_text(json.dumps(sorted(runs, key=lambda r: json.dumps(
            {k: r.get(k) for k in ("cv", "policy", "seed", "ablate", "models", "params")}, sort_keys=True)),
            separators=(",", ":")))
    rows, ablation, dag = fig7_rows(runs), ablation_rows(runs), dag_rows(runs)
    headroom = headroom_rows(runs, rows)
    ratios = against_best(rows)
    print(table(f"Fig. 7: 5 models x 10 req/s, {a.duration:g} s, mean and 95 % interval over {a.seeds} seeds",
                ["entry CV", "policy", "mean ms", "±", "goodput req/s", "±", "replica-s"],
                [[r["cv"], r["policy"], round(r["mean_ms"]), round(r["mean_ci_ms"]), round(r["goodput"], 2),
                  round(r["goodput_ci"], 2), round(r["replica_s"])] for r in rows]))
    print(table("QUART against the best baseline at each CV (ratios of means; separate: the 95 % intervals do not overlap)",
                ["entry CV", "policy", "latency ×", "vs", "separate", "goodput ×", "vs", "separate"],
                [[r["cv"], r["policy"], round(r["latency_ratio"], 2), r["best_latency_baseline"], r["latency_separate"],
                  round(r["goodput_ratio"], 2), r["best_goodput_baseline"], r["goodput_separate"]] for r in ratios]))
    print(table("Ablation: without one mechanism (QUART_ABLATE)", ["policy", "CV", "without", "mean ms", "±", "goodput", "±"],
                [[r["policy"], r["cv"], r["without"], round(r["mean_ms"]), round(r["mean_ci_ms"]), round(r["goodput"], 2),
                  round(r["goodput_ci"], 2)] for r in ablation]))
    print(table("The DAG (ensemble-8 alone, 10 req/s): QUART with and without CV attention",
                ["CV", "attention", "mean ms", "±", "goodput", "±", "replica-s"],
                [[r["cv"], r["attention"], round(r["mean_ms"]), round(r["mean_ci_ms"]), round(r["goodput"], 2),
                  round(r["goodput_ci"], 2), round(r["replica_s"])] for r in dag]))
    print(table("Headroom: quart-flow sizing stages for a lower utilization, against the fastest baseline",
                ["CV", "policy", "mean ms", "±", "latency ×", "separate", "goodput", "±", "replica-s"],
                [[r["cv"], r["policy"], round(r["mean_ms"]), round(r["mean_ci_ms"]), round(r["latency_ratio"], 3),
                  r["separate"], round(r["goodput"], 2), round(r["goodput_ci"], 2), round(r["replica_s"])]
                 for r in headroom]))
    plot(rows, runs)
    plot_headroom(rows, headroom)
    cv_model = json.loads((artefacts.SHIPPED / "cv_attention.json").read_text())
    figures = [{"name": f"fig7 cv{r['cv']:g} {r['policy']} mean latency", "value": round(r["mean_ms"], 1), "unit": "ms",
                "ci95": round(r["mean_ci_ms"], 1)} for r in rows]
    figures += [{"name": f"fig7 cv{r['cv']:g} {r['policy']} goodput", "value": round(r["goodput"], 3), "unit": "req/s",
                 "ci95": round(r["goodput_ci"], 3)} for r in rows]
    figures += [{"name": f"fig7 cv{r['cv']:g} {r['policy']} replica-seconds", "value": round(r["replica_s"]), "unit": "s"}
                for r in rows]
    figures += [{"name": f"cv{r['cv']:g} {r['policy']} latency / best baseline ({r['best_latency_baseline']})",
                 "value": round(r["latency_ratio"], 3), "unit": "ratio", "separate": r["latency_separate"]} for r in ratios]
    figures += [{"name": f"cv{r['cv']:g} {r['policy']} goodput / best baseline ({r['best_goodput_baseline']})",
                 "value": round(r["goodput_ratio"], 3), "unit": "ratio", "separate": r["goodput_separate"]} for r in ratios]
    figures += [{"name": f"ablation {r['policy']} cv{r['cv']:g} without {r['without']} mean latency",
                 "value": round(r["mean_ms"], 1), "unit": "ms", "ci95": round(r["mean_ci_ms"], 1)} for r in ablation]
    figures += [{"name": f"ablation {r['policy']} cv{r['cv']:g} without {r['without']} goodput",
                 "value": round(r["goodput"], 3), "unit": "req/s", "ci95": round(r["goodput_ci"], 3)} for r in ablation]
    figures += [{"name": f"dag ensemble-8 cv{r['cv']:g} attention {'on' if r['attention'] else 'off'} mean latency",
                 "value": round(r["mean_ms"], 1), "unit": "ms", "ci95": round(r["mean_ci_ms"], 1),
                 "goodput": round(r["goodput"], 3), "replica_s": round(r["replica_s"])} for r in dag]
    figures += [{"name": f"headroom cv{r['cv']:g} {r['policy']} mean latency", "value": round(r["mean_ms"], 1), "unit": "ms",
                 "ci95": round(r["mean_ci_ms"], 1), "goodput": round(r["goodput"], 3), "replica_s": round(r["replica_s"]),
                 "latency_ratio_fastest_baseline": round(r["latency_ratio"], 4), "separate": r["separate"]}
                for r in headroom]
    figures += [{"name": "cv attention theta", "value": round(cv_model["theta"], 4), "unit": ""}]
    for scope in ("all", "dag"):
        if cv_model.get(scope):
            figures += [{"name": f"cv attention held-out MAE ({scope}) stage {i}", "value": m, "unit": "CV", "naive": n}
                        for i, (m, n) in enumerate(zip(cv_model[scope]["model_mae"], cv_model[scope]["naive_mae"]))]
    attainment = {p: np.mean([[r["models_out"][m]["attainment"] for m in r["models_out"]] for r in select(runs, 4.0, p)],
                             axis=0).round(4).tolist() for p in POLICIES}
    figures += [{"name": f"fig6 cv4 {p} SLO attainment per model at {list(SLO_MULTIPLES)}x", "value": attainment[p],
                 "unit": "fraction", "models": [m.name for m in table1()]} for p in POLICIES]
    write("simulator_policies", figures, conditions(
        seeds=a.seeds, duration_s=a.duration, rate_per_model_rps=RATE, slo=f"{SLO_X:g}x unloaded latency",
        testbed="12 servers x 4 GPUs x 4 slots, 1 TB", split="even (8 stages)",
        inferline_plan="the trace's rate and CV",
        plots="simulator_fig7.png, simulator_fig8.png, simulator_headroom.png"))
    return {"fig7": rows, "against_best": ratios, "ablation": ablation, "dag": dag, "headroom": headroom}


if __name__ == "__main__":
    main(sys.argv[1:])
