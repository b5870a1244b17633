"""The cache-aware scheduler (scheduler/placement.py) on generated cluster states.

1. Placement time for 1,000 new replicas on 100 and on 1,000 servers, under light and heavy
   contention (target: at most 1 s), on one core.
2. Against first-fit and random placement on the same states: key-stage dispersion (largest
   share of a key stage on one server, entropy over servers), free slots on the servers that host
   a key stage (room to grow), and the share of new replicas that start by fork. Medians over
   generated states; a bar chart in benchmarks/results/placement.png."""
from __future__ import annotations

import time

import numpy as np

from benchmarks.report import RESULTS, conditions, table, write
from scheduler import generate
from scheduler.baselines import FirstFit, RandomFit
from scheduler.evaluate import apply, dispersion
from scheduler.placement import Scheduler

MEASURES = ("scheduler",)  # the code measured (benchmarks/freshness.py)

# (servers, slots, occupancy): 1,000 adds in 1,440 and 2,400 free slots (heavy, light) on 100
# servers, and in 1,200 and 2,400 on 1,000 servers.
TIMING = [(100, 24, 0.4), (100, 40, 0.4), (1000, 4, 0.7), (1000, 4, 0.4)]
METRICS = ["max_share", "entropy", "headroom", "fork_share"]


def timing(repeats: int) -> list[dict]:
    out = []
    for servers, slots, occupancy in TIMING:
        state = generate.cluster(servers, slots=slots, occupancy=occupancy, seed=1)
        changes = generate.burst(state, 1000, seed=1)
        times, schedule = [], None
        for _ in range(repeats):
            t0 = time.perf_counter()
            schedule = Scheduler().schedule(state, changes)
            times.append((time.perf_counter() - t0) * 1000.0)
        out.append({"servers": servers, "slots": slots, "free": servers * slots - len(state.replicas),
                    "contention": schedule.contention, "placed": len(schedule.placements),
                    "median_ms": float(np.median(times)), "max_ms": max(times)})
    return out


def comparison(states: int, instances: int, occupancy: float) -> dict[str, dict[str, float]]:
    results: dict[str, dict[str, list[float]]] = {}
    for seed in range(states):
        state = generate.cluster(100, slots=8, occupancy=occupancy, seed=100 + seed)
        changes = generate.burst(state, instances, seed=100 + seed)
        for name, policy in (("quart", Scheduler()), ("first-fit", FirstFit()), ("random", RandomFit(seed))):
            schedule = policy.schedule(state, changes)
            d = dispersion(apply(state, schedule), schedule).as_dict()
            for metric in METRICS:
                results.setdefault(name, {}).setdefault(metric, []).append(d[metric])
    return {name: {m: float(np.median(v)) for m, v in ms.items()} for name, ms in results.items()}


def plot(compared: dict[str, dict[str, dict[str, float]]]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(compared), len(METRICS), figsize=(13, 3.2 * len(compared)), squeeze=False)
    for row, (label, by_policy) in enumerate(compared.items()):
        for col, metric in enumerate(METRICS):
            ax = axes[row][col]
            names = list(by_policy)
            ax.bar(names, [by_policy[n][metric] for n in names], color=["C0", "C1", "C2"])
            ax.set_title(f"{metric} ({label})", fontsize=9)
    fig.suptitle("Key-stage placement: QUART scheduler vs first-fit and random (medians over states)")
    fig.tight_layout()
    fig.savefig(RESULTS / "placement.png", dpi=110)


def main(repeats: int = 5, states: int = 20) -> dict:
    times = timing(repeats)
    print(table("Placement time for 1,000 new replicas, one core (target <= 1000 ms)",
                ["servers", "slots", "free", "contention", "placed", "median ms", "max ms"],
                [[t["servers"], t["slots"], t["free"], t["contention"], t["placed"], round(t["median_ms"], 1),
                  round(t["max_ms"], 1)] for t in times]))
    compared = {"light, 40 adds": comparison(states, 40, 0.4), "heavy, 250 adds": comparison(states, 250, 0.6)}
    figures = [{"name": f"placement time {t['servers']} servers {t['contention']}", "value": round(t["median_ms"], 2),
                "unit": "ms", **t} for t in times]
    for label, by_policy in compared.items():
        rows = [[name] + [round(v[m], 3) for m in METRICS] for name, v in by_policy.items()]
        print(table(f"100 servers x 8 slots, {label}: medians over {states} states "
                    "(max_share lower and entropy higher = more dispersed)", ["policy"] + METRICS, rows))
        for name, v in by_policy.items():
            figures += [{"name": f"{label} {name} {m}", "value": round(v[m], 4),
                         "unit": {"max_share": "fraction", "entropy": "nats", "headroom": "slots",
                                  "fork_share": "fraction"}[m]} for m in METRICS]
    RESULTS.mkdir(parents=True, exist_ok=True)
    plot(compared)
    write("placement", figures, conditions(repeats=repeats, states=states, threads=1,
                                           generator="scheduler/generate.py, 5 models x 8 stages, key stage 3, "
                                                     "30 % of stages cached per server"))
    return {"timing": times, "comparison": compared}


if __name__ == "__main__":
    main()
