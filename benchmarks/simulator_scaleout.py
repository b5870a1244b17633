"""λScale's scale-out figures (§7.3–§7.5) from the scale-out simulator (sim/scaleout.py):
λScale (k-way multicast with execute-while-load), the same multicast answering only once whole,
FaaSNet's binary tree, ServerlessLLM's SSD loads, and ideal scaling, on λScale's testbed 1
(400 Gb/s, SSD 5 GB/s, H800s, b = 16):

- time to scale 1 → N: until the first new slots answer and until all N servers' do (N = 2…32,
  Llama-2 13B, 100 and 400 Gb/s);
- throughput over time during a 1 → 8 (k = 1) and k → 8 (k = 2, 4) scale-out under a backlog of
  2048 requests (Fig. 9), and the time until it reaches 90 % of eight servers' throughput;
- a burst of 50 requests on one warm server scaled to 8 (Fig. 12): the TTFT of the last;
- 30 minutes of a BurstGPT-shaped trace (bursty, heavy-tailed lengths; `loadgen.arrivals`) with
  the same autoscaling rule for every system (Fig. 14–15): TTFT p50/p90/p99, attainment of a 1 s
  TTFT objective and GPU-hours, medians over 3 seeds, at 100 and 400 Gb/s.

Modelled, not measured: see sim/scaleout.py for what the per-token costs assume. The rates of the
BurstGPT-shaped runs were chosen (here, once) so that its bursts need most of the 12 servers.

    python -m benchmarks simulator_scaleout
"""
from __future__ import annotations

import math
import statistics
import sys

import numpy as np

from benchmarks.report import RESULTS, conditions, table, write
from sim.scaleout import MODELS, SYSTEMS, Fabric, burst, burstgpt_like, simulate

MEASURES = ("sim/scaleout.py", "scheduler/multicast.py", "loadgen/arrivals.py")  # the code measured (benchmarks/freshness.py)

SCALED = ("lambdascale", "multicast", "faasnet", "serverlessllm")
SERVERS = (2, 4, 8, 12, 16, 32)
LINKS_GBPS = (100, 400)
HOLDERS = (1, 2, 4)
BACKLOG, BURST, STEP_S, HORIZON_S = 2048, 50, 0.05, 8.0
RATES = {"llama2-7b": 20.0, "llama2-13b": 10.0, "llama2-70b": 4.0}
TRACE_S, SEEDS, TTFT_OBJECTIVE_S = 1800.0, (0, 1, 2), 1.0
# λScale's own figures (§1, §7.2–§7.5), measured on its testbed, quoted beside these.
PAPER = {"scale_13b_8": "Llama-2 13B to 8 servers in under 1 s",
         "ramp_13b": "13B throughput starts rising at about 1.2 s with k = 1, 0.25 s with k = 4",
         "burst_50": "all 50 requests served in 1.1 s: 2x faster than FaaSNet, 1.4x than NCCL, 8x than ServerlessLLM",
         "burstgpt": "p90 TTFT 2.4x to 5x better, GPU time 17.8 % to 31.3 % lower than the baselines"}


def fabric(gbps: float, **changes) -> Fabric:
    return Fabric(link_bytes_s=gbps * 1e9 / 8, **changes)


def scale_times(figures: list) -> dict:
    """(Gb/s, N, system): seconds until the first new slots answer and until all N servers' do."""
    times = {}
    for gbps in LINKS_GBPS:
        for n in SERVERS:
            for name in SCALED:
                r = simulate(name, "llama2-13b", [], fabric(gbps, servers=n), warm=1, scale_to=n)
                first, full = times[(gbps, n, name)] = r.capacity_at(Fabric.batch + 1), r.capacity_at(n * Fabric.batch)
                where = f"llama2-13b 1->{n}, {gbps} Gb/s"
                figures += [{"name": f"{name} first new slots answer, {where}", "value": round(first, 4), "unit": "s", "modelled": True},
                            {"name": f"{name} all {n} servers answer, {where}", "value": round(full, 4), "unit": "s", "modelled": True}]
    print(table("Scale 1 -> N, Llama-2 13B: seconds until the first new slots answer / until all N servers' do",
                ["Gb/s", "N", *SCALED],
                [[gbps, n, *(f"{times[(gbps, n, name)][0]:.2f} / {times[(gbps, n, name)][1]:.2f}" for name in SCALED)]
                 for gbps in LINKS_GBPS for n in SERVERS]))
    return times


def ramps(figures: list) -> dict:
    curves, lines = {}, []
    for model in MODELS:
        servers = 6 if MODELS[model].gpus > 1 else 8  # λScale's testbed 2 has 6 servers of 4 GPUs
        peak = servers * Fabric.batch / MODELS[model].tpot_s
        for k in HOLDERS:
            row = [model, f"{k}->{servers}"]
            for name in SCALED:
                r = simulate(name, model, burst(BACKLOG), fabric(400, servers=servers), warm=k, scale_to=servers)
                tps = r.throughput(HORIZON_S, STEP_S)
                curves[(model, k, name)] = tps
                reach = np.flatnonzero(tps >= 0.9 * peak)
                t90 = float(reach[0] * STEP_S) if reach.size else math.inf
                row.append(t90)
                figures.append({"name": f"{name} time to 90% of {servers} servers' throughput, {model}, k={k}, 400 Gb/s",
                                "value": round(t90, 3) if math.isfinite(t90) else None, "unit": "s", "modelled": True,
                                "note": "" if math.isfinite(t90) else f"not within {HORIZON_S} s"})
            lines.append(row)
    print(table(f"Seconds until throughput reaches 90% of N servers' (backlog of {BACKLOG}, 400 Gb/s; inf: not in {HORIZON_S} s)",
                ["model", "k->N", *SCALED], lines))
    return curves


def burst_ttft(figures: list) -> None:
    last = {name: max(simulate(name, "llama2-13b", burst(BURST), fabric(400, servers=8), warm=1, scale_to=8).ttft)
            for name in SCALED}
    print(table(f"A burst of {BURST} requests, one warm server scaled to 8 (Llama-2 13B, 400 Gb/s): TTFT of the last",
                ["system", "seconds", "over lambdascale"],
                [[n, last[n], f"{last[n] / last['lambdascale']:.2f}x"] for n in SCALED]))
    figures += [{"name": f"{n} TTFT of the last of {BURST}, llama2-13b 1->8, 400 Gb/s", "value": round(last[n], 4),
                 "unit": "s", "modelled": True, **({"paper": PAPER["burst_50"]} if n == "lambdascale" else {})}
                for n in SCALED]


def traces(figures: list) -> dict:
    rows, cdfs = {}, {}
    for model, rate in RATES.items():
        for gbps in LINKS_GBPS:
            for name in SYSTEMS:
                runs = [simulate(name, model, burstgpt_like(rate, TRACE_S, seed), fabric(gbps)) for seed in SEEDS]
                ttfts = [np.array(r.ttft) for r in runs]
                rows[(model, gbps, name)] = {
                    **{f"p{q}": statistics.median(float(np.percentile(t, q)) for t in ttfts) for q in (50, 90, 99)},
                    "attainment": statistics.median(float(np.mean(t <= TTFT_OBJECTIVE_S)) for t in ttfts),
                    "gpu_hours": statistics.median(r.gpu_seconds / 3600 for r in runs),
                    "pipelines": statistics.median(r.starts["pipeline"] for r in runs),
                    "starts": statistics.median(r.starts["local"] + r.starts["pipeline"] for r in runs)}
                if gbps == 400 and model == "llama2-13b":
                    cdfs[name] = np.sort(ttfts[0])
    for model in RATES:
        for gbps in LINKS_GBPS:
            base = rows[(model, gbps, "lambdascale")]
            print(table(f"{model}, BurstGPT-shaped at {RATES[model]} requests/s, {gbps} Gb/s, {TRACE_S / 60:.0f} min "
                        f"(medians of {len(SEEDS)} seeds)",
                        ["system", "p50 s", "p90 s", "p99 s", f"TTFT<={TTFT_OBJECTIVE_S:g}s", "GPU-h", "starts",
                         "pipelines", "p90 / lambdascale", "GPU-h / lambdascale"],
                        [[n, r["p50"], r["p90"], r["p99"], r["attainment"], r["gpu_hours"], r["starts"], r["pipelines"],
                          f"{r['p90'] / base['p90']:.2f}x", f"{r['gpu_hours'] / base['gpu_hours']:.3f}x"]
                         for n in SYSTEMS for r in [rows[(model, gbps, n)]]]))
            for n in SYSTEMS:
                r = rows[(model, gbps, n)]
                where = f"{model}, BurstGPT-shaped {RATES[model]}/s, {gbps} Gb/s"
                figures += [{"name": f"{n} TTFT p90, {where}", "value": round(r["p90"], 4), "unit": "s", "modelled": True},
                            {"name": f"{n} TTFT p99, {where}", "value": round(r["p99"], 4), "unit": "s", "modelled": True},
                            {"name": f"{n} TTFT <= {TTFT_OBJECTIVE_S:g} s, {where}", "value": round(r["attainment"], 4),
                             "unit": "fraction", "modelled": True},
                            {"name": f"{n} GPU-hours, {where}", "value": round(r["gpu_hours"], 3), "unit": "GPU-h", "modelled": True},
                            {"name": f"{n} execution pipelines started, {where}", "value": r["pipelines"], "unit": "count", "modelled": True}]
    return cdfs


def plot(scale: dict, curves: dict, cdfs: dict, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 4, figsize=(18, 3.8))
    for name in SCALED:
        axes[0].plot(SERVERS, [scale[(400, n, name)][1] for n in SERVERS], marker="o", label=name)
    axes[0].set(xscale="log", yscale="log", xlabel="servers N", ylabel="s until all N answer", title="Llama-2 13B, 1 -> N, 400 Gb/s")
    axes[0].set_xticks(SERVERS, [str(n) for n in SERVERS])
    axes[0].minorticks_off()
    times = np.arange(len(next(iter(curves.values())))) * STEP_S
    for ax, k in zip(axes[1:3], (1, 4)):
        for name in SCALED:
            ax.plot(times, curves[("llama2-13b", k, name)] / 1000, label=name)
        ax.set(xlim=(0, 3), xlabel="seconds", ylabel="thousand tokens/s", title=f"Llama-2 13B, {k} -> 8, backlog {BACKLOG}")
    for name, values in cdfs.items():
        axes[3].plot(values, np.arange(1, len(values) + 1) / len(values), label=name)
    axes[3].set(xscale="log", xlabel="TTFT s", ylabel="CDF", title="Llama-2 13B, BurstGPT-shaped, 400 Gb/s")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    figures: list[dict] = []
    scale = scale_times(figures)
    curves = ramps(figures)
    burst_ttft(figures)
    cdfs = traces(figures)
    png = RESULTS / "simulator_scaleout.png"
    plot(scale, curves, cdfs, png)
    defaults = Fabric()
    path = write("simulator_scaleout", figures, conditions(
        modelled=True, fabric={k: getattr(defaults, k) for k in defaults.__dataclass_fields__},
        models={m.name: {"bytes": m.bytes, "params": m.params, "gpus": m.gpus, "tpot_s": round(m.tpot_s, 5)}
                for m in MODELS.values()},
        rates_per_s=RATES, trace_s=TRACE_S, seeds=list(SEEDS), ttft_objective_s=TTFT_OBJECTIVE_S,
        backlog=BACKLOG, burst=BURST, paper=PAPER, tuned="the trace rates were chosen once so bursts need most servers",
        plot=png.name))
    print(f"wrote {path} and {png}")


if __name__ == "__main__":
    main(sys.argv[1:])
