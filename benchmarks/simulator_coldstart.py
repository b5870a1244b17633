"""HydraServe's end-to-end figures (§8.3, Fig. 9 and 10) from the serverless LLM simulator
(sim/serverless.py): TTFT SLO attainment of serverless vLLM, ServerlessLLM, this project's stage
functions cold-started one after another (quart-sequential) and with HydraServe's mechanisms
(hydraserve), on HydraServe's testbed (i) with 192 long-tail Llama2 models:

- against CV (1, 2, 4, 8) at 0.2, 0.4 and 0.6 requests per second (Fig. 9);
- against the SLO scale (0.5 to 3) at CV 8 and 0.6 requests per second (Fig. 10).

One simulated hour per point, medians over 3 seeds (the arrivals and the models' popularity).

    python -m benchmarks simulator_coldstart
"""
from __future__ import annotations

import statistics
import sys

from benchmarks.report import RESULTS, conditions, table, write
from sim.serverless import SYSTEMS, Workload, ratio, simulate, testbed

MEASURES = ("sim/serverless.py", "scheduler/coldstart.py", "loadgen/arrivals.py")  # the code measured (benchmarks/freshness.py)

CVS, RATES, SCALES, SEEDS = (1, 2, 4, 8), (0.2, 0.4, 0.6), (0.5, 1.0, 1.5, 2.0, 3.0), (0, 1, 2)


def attainment(system: str, **workload) -> tuple[float, dict]:
    runs = [simulate(system, Workload(seed=seed, **workload)) for seed in SEEDS]
    return statistics.median(r.attainment() for r in runs), {
        "requests": statistics.median(len(r.ttft) for r in runs),
        "cold_starts": statistics.median(r.cold_starts for r in runs),
        "pipelined_cold_starts": statistics.median(r.pipelined for r in runs),
        "consolidations": statistics.median(r.consolidated for r in runs),
        "mean_ttft_s": statistics.median(statistics.mean(r.ttft) for r in runs),
        "gpu_hours": statistics.median(r.gpu_seconds / 3600 for r in runs)}


def plot(by_cv: dict, by_scale: dict, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(RATES) + 1, figsize=(4 * (len(RATES) + 1), 3.6), sharey=True)
    for ax, rps in zip(axes, RATES):
        for system in SYSTEMS:
            ax.plot(CVS, [by_cv[(system, rps, cv)] for cv in CVS], marker="o", label=system)
        ax.set_xscale("log", base=2)
        ax.set_xticks(CVS, [str(c) for c in CVS])
        ax.set_xlabel("CV")
        ax.set_title(f"{rps} requests/s")
    axes[0].set_ylabel("TTFT SLO attainment")
    for system in SYSTEMS:
        axes[-1].plot(SCALES, [by_scale[(system, s)] for s in SCALES], marker="o", label=system)
    axes[-1].set_xlabel("SLO scale")
    axes[-1].set_title("CV 8, 0.6 requests/s")
    axes[-1].legend(fontsize=8)
    for ax in axes:
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    by_cv, by_scale, figures = {}, {}, []
    for rps in RATES:
        for cv in CVS:
            for system in SYSTEMS:
                value, extra = attainment(system, rps=rps, cv=cv)
                by_cv[(system, rps, cv)] = value
                figures.append({"name": f"TTFT SLO attainment, {system}, {rps} rps, CV {cv}", "value": round(value, 4),
                                "unit": "fraction", **extra})
    for scale in SCALES:
        for system in SYSTEMS:
            value, extra = attainment(system, rps=0.6, cv=8, slo_scale=scale)
            by_scale[(system, scale)] = value
            figures.append({"name": f"TTFT SLO attainment, {system}, SLO scale {scale}, 0.6 rps, CV 8",
                            "value": round(value, 4), "unit": "fraction", **extra})
    baselines = ("serverless-vllm", "serverlessllm")
    gains = [ratio(by_cv[("hydraserve", rps, cv)], max(by_cv[(b, rps, cv)] for b in baselines))
             for rps in RATES for cv in CVS]
    figures.append({"name": "hydraserve's attainment over the better baseline, across rates and CVs (min, max)",
                    "value": [round(min(gains), 3), round(max(gains), 3)], "unit": "ratio"})
    rows = [[f"{rps} rps, CV {cv}"] + [by_cv[(s, rps, cv)] for s in SYSTEMS] for rps in RATES for cv in CVS]
    rows += [[f"SLO x{scale}, CV 8, 0.6 rps"] + [by_scale[(s, scale)] for s in SYSTEMS] for scale in SCALES]
    print(table("TTFT SLO attainment (medians of 3 seeds, one simulated hour each)", ["workload", *SYSTEMS], rows))
    png = RESULTS / "simulator_coldstart.png"
    plot(by_cv, by_scale, png)
    servers = testbed()
    path = write("simulator_coldstart", figures, conditions(
        simulated_hour=True, seeds=list(SEEDS), servers=[s.name for s in servers],
        gpus=sum(s.gpus for s in servers), models=192, workload=Workload().__dict__, plot=png.name))
    print(f"wrote {path} and {png}")


if __name__ == "__main__":
    main(sys.argv[1:])
