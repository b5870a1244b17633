"""The cluster simulator (sim/): its speed, and QUART's Fig. 2a/2b at its testbed's scale.
The policies' figures (Fig. 6-8, the ablation, the DAG) are benchmarks/simulator_policies.py's;
its calibration against the live runtime is benchmarks/live_policies.py's; the CV-attention
model's held-out error is the artefact's own (`python -m tools.artefacts --only cv`).

1. Speed: one hour of Gamma arrivals at 50 req/s over QUART Table 1's 5 models x 8 stages on
   12 servers x 4 GPUs under QUART, on one core (target <= 60 s).
2. Fig. 2a/2b: each model alone on the testbed at 1 replica per stage, split evenly and in its
   uneven variant, the heaviest stage at 85 % utilisation, entry CV 0.1 and 4: per-stage
   inter-arrival CV and mean queue length."""
from __future__ import annotations

import time

import numpy as np
import torch

from benchmarks.report import RESULTS, SIMULATOR, conditions, table, write
from contracts.config import Settings, load_settings
from loadgen.arrivals import gamma_arrivals
from sim.config import quart_testbed
from sim.models import table1
from sim.run import simulate, stage_timeline

MEASURES = SIMULATOR + ("autoscaler", "loadgen", "contracts")  # the code measured (benchmarks/freshness.py)

FIG7_CVS = (0.1, 1.0, 2.0, 4.0, 8.0)


NO_HOME = "/nonexistent-quart-home"


def _settings(**changes: object) -> Settings:
    """No trained CV model or CPU fits: the policies as a fresh installation runs them."""
    return load_settings(environ={}, home=NO_HOME, **changes)


def speed() -> dict:
    models = table1()
    arrivals = {m.name: gamma_arrivals(10.0, 1.0, 3600.0, seed=k) for k, m in enumerate(models)}
    wall, cpu = time.perf_counter(), time.process_time()
    trace = simulate(quart_testbed(tail_s=5.0), models, arrivals, "quart", _settings(), record_arrivals=False)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"wall_s": wall, "cpu_s": cpu, "requests": len(trace.sent), "ok": int((trace.status == 200).sum()),
            "events": trace.events, "decisions": trace.decisions, **trace.starts}


def fig2(duration: float = 600.0) -> list[dict]:
    rows = []
    for m in table1([*(m.name for m in table1()), *(m.name + "-uneven" for m in table1())]):
        heaviest = max(range(m.num_stages), key=m.profile.stage_ms)
        rate = 0.85 / (m.profile.stage_ms(heaviest) / 1000.0)
        for cv in (0.1, 4.0):
            cfg = quart_testbed(tail_s=0.0)
            trace = simulate(cfg, [m], {m.name: gamma_arrivals(rate, cv, duration, seed=1)}, "static", _settings())
            t = stage_timeline(trace, cfg, m)
            rows.append({"model": m.name, "entry_cv": cv, "rate": rate, "heaviest": heaviest,
                         "cv": t["cv"], "queue": t["mean_queue"], "longest_queue": int(np.argmax(t["mean_queue"]))})
    return rows


def plot(f2: list[dict]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
    for col, cv in enumerate((0.1, 4.0)):
        for r in (r for r in f2 if r["entry_cv"] == cv):
            style = {"linestyle": "--", "alpha": 0.6} if r["model"].endswith("-uneven") else {}
            axes[0][col].plot(range(len(r["cv"])), r["cv"], marker="o", label=r["model"], **style)
            axes[1][col].plot(range(len(r["queue"])), r["queue"], marker="o", label=r["model"], **style)
        axes[0][col].set(title=f"Fig. 2a (simulated): inter-arrival CV per stage, entry CV {cv:g}", xlabel="stage")
        axes[1][col].set(title=f"Fig. 2b (simulated): mean queue per stage, entry CV {cv:g}", xlabel="stage",
                         yscale="log")
        for ax in (axes[0][col], axes[1][col]):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(RESULTS / "simulator_fig2.png", dpi=100)
    plt.close(fig)


def main() -> dict:
    torch.set_num_threads(1)
    s = speed()
    print(table("Speed: 1 h at 50 req/s, 5 models x 8 stages, 12 x 4 GPUs, QUART, one core",
                ["wall s", "CPU s", "requests", "answered", "events", "decisions", "forks", "cold"],
                [[round(s["wall_s"], 1), round(s["cpu_s"], 1), s["requests"], s["ok"], s["events"], s["decisions"],
                  s["fork"], s["cold"]]]))
    f2 = fig2()
    print(table("Fig. 2a/2b: static, 1 replica per stage, heaviest stage at 85 % utilisation (even split: every stage)",
                ["model", "entry CV", "CV per stage", "mean queue per stage", "longest queue"],
                [[r["model"], r["entry_cv"], " ".join(f"{c:.2f}" for c in r["cv"]),
                  " ".join(f"{q:.1f}" for q in r["queue"]), r["longest_queue"]] for r in f2]))
    plot(f2)
    figures = [{"name": "simulate 1 h at 50 req/s, 5 models x 8 stages, 48 GPUs (wall)", "value": round(s["wall_s"], 2), "unit": "s"},
               {"name": "simulate 1 h at 50 req/s (CPU)", "value": round(s["cpu_s"], 2), "unit": "s"},
               {"name": "simulated events in 1 h", "value": s["events"], "unit": "events"}]
    figures += [{"name": f"fig2 {r['model']} cv{r['entry_cv']:g} longest queue stage", "value": r["longest_queue"], "unit": "stage",
                 "cv_per_stage": [round(c, 3) for c in r["cv"]], "mean_queue_per_stage": [round(q, 2) for q in r["queue"]]}
                for r in f2]
    write("simulator", figures, conditions(speed_models=5, speed_rate_rps=50, speed_seconds=3600, fig2_seconds=600,
                                           split="even; -uneven: stage 3 weighs 1.6", plots="simulator_fig2.png"))
    return {"speed": s, "fig2": f2}


if __name__ == "__main__":
    main()
