"""λScale's multicast (§4.2, Fig. 7) as this project's planner schedules it (scheduler/multicast.py):
the time to send a model from k servers that hold it to the rest of N, at λScale's scale: Llama-2
7B, 13B and 70B (FP16: 13.5, 26 and 138 GB), N = 2 to 32 servers, 100 to 400 Gb/s links (λScale's
testbed: 400 Gb/s), b = 16 blocks (λScale §7.6's best count), k = 1, 2 and 4 holders. Beside each:
FaaSNet's binary tree and one holder sending to each server in turn.

Modelled, not measured: a plan of R rounds takes R·M/(b·B), every link at its full rate and no
cost per block or per round (λScale's RDMA request overhead and NCCL's group set-up are not in
it). So the ratios are the planners' alone; λScale measured up to 1.82x over FaaSNet with those
costs in. The live multicast between KeysManagers (runtime/multicast.py) is not measured here.

    python -m benchmarks simulator_multicast
"""
from __future__ import annotations

import sys

from benchmarks.report import RESULTS, conditions, table, write
from scheduler.multicast import binary_tree_rounds, lower_bound_rounds, plan, unicast_rounds

MEASURES = ("scheduler/multicast.py",)  # the code measured (benchmarks/freshness.py)

GB = 1e9
MODELS = {"llama2-7b": 13.5 * GB, "llama2-13b": 26.0 * GB, "llama2-70b": 138.0 * GB}
SERVERS = (2, 4, 8, 12, 16, 32)
LINKS_GBPS = (100, 200, 400)
HOLDERS = (1, 2, 4)
BLOCKS = 16
PAPER_BEST_OVER_FAASNET = 1.82  # λScale §7.2, measured on its testbed


def times(n: int, k: int, model_bytes: float, gbps: float, blocks: int = BLOCKS) -> dict[str, float]:
    """Seconds until every server holds the model: binomial (k holders), binary tree and unicast
    (one holder), and λScale's b + ⌈log₂N⌉ − 1 rounds for one holder."""
    names = [f"s{i}" for i in range(n)]
    block_s = model_bytes / blocks / (gbps * 1e9 / 8)
    return {"binomial": len(plan(names[:k], names[k:], blocks).rounds) * block_s,
            "model": lower_bound_rounds(n, blocks) * block_s,
            "binary_tree": binary_tree_rounds(n, blocks) * block_s,
            "unicast": unicast_rounds(n, blocks) * block_s}


def plot(rows: dict, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(MODELS), figsize=(4.2 * len(MODELS), 3.6))
    for ax, model in zip(axes, MODELS):
        for label, key in (("binomial k=1", ("binomial", 1)), ("binomial k=2", ("binomial", 2)),
                           ("binomial k=4", ("binomial", 4)), ("binary tree", ("binary_tree", 1)),
                           ("unicast", ("unicast", 1))):
            xs = [n for n in SERVERS if key[1] < n]
            ax.plot(xs, [rows[(model, n, 400, key[1])][key[0]] for n in xs], marker="o", label=label)
        ax.set_xlabel("servers N")
        ax.set_title(f"{model}, 400 Gb/s, b={BLOCKS}")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("seconds until all hold it (modelled)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    rows, figures, lines = {}, [], []
    for model, size in MODELS.items():
        for gbps in LINKS_GBPS:
            for n in SERVERS:
                for k in (k for k in HOLDERS if k < n):
                    t = rows[(model, n, gbps, k)] = times(n, k, size, gbps)
                    for method in ("binomial", "model") if k > 1 else ("binomial", "model", "binary_tree", "unicast"):
                        if k > 1 and method == "model":
                            continue
                        figures.append({"name": f"{method} time, {model}, N={n}, k={k}, {gbps} Gb/s, b={BLOCKS}",
                                        "value": round(t[method], 4), "unit": "s", "modelled": True})
                    if gbps == 400:
                        lines.append([model, n, k, t["binomial"], t["model"] if k == 1 else "",
                                      t["binary_tree"] if k == 1 else "", t["unicast"] if k == 1 else "",
                                      f"{t['binary_tree'] / t['binomial']:.2f}x" if k == 1 else ""])
    print(table(f"Seconds until all N hold the model, 400 Gb/s, b={BLOCKS} (modelled: rounds x block time)",
                ["model", "N", "k", "binomial", "b+log2N-1", "binary tree", "unicast", "tree/binomial"], lines))
    ratios = [rows[(m, n, 400, 1)]["binary_tree"] / rows[(m, n, 400, 1)]["binomial"] for m in MODELS for n in (4, 8, 12)]
    figures.append({"name": "binary tree over binomial, N in 4, 8, 12 (min, max)",
                    "value": [round(min(ratios), 3), round(max(ratios), 3)], "unit": "ratio", "modelled": True,
                    "paper": f"up to {PAPER_BEST_OVER_FAASNET}x over FaaSNet, measured"})
    worst = max(len(plan([f"s{i}" for i in range(1)], [f"s{i}" for i in range(1, n)], BLOCKS).rounds)
                - lower_bound_rounds(n, BLOCKS) for n in range(2, 65))
    figures.append({"name": f"rounds over b+ceil(log2 N)-1, one holder, N = 2..64, b={BLOCKS} (max)",
                    "value": worst, "unit": "rounds"})
    print(f"binary tree over binomial at N = 4, 8, 12: {min(ratios):.2f}x to {max(ratios):.2f}x "
          f"(λScale measured up to {PAPER_BEST_OVER_FAASNET}x over FaaSNet); "
          f"the planner is at most {worst} round(s) above b + ceil(log2 N) - 1 for N = 2..64")
    png = RESULTS / "simulator_multicast.png"
    plot(rows, png)
    path = write("simulator_multicast", figures, conditions(
        modelled=True, blocks=BLOCKS, links_gbps=list(LINKS_GBPS), servers=list(SERVERS), holders=list(HOLDERS),
        model_bytes=MODELS, plot=png.name))
    print(f"wrote {path} and {png}")


if __name__ == "__main__":
    main(sys.argv[1:])
