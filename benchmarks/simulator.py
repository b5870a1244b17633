"""The cluster simulator (sim/): speed, calibration against the embedded runtime, QUART's
Fig. 2a/2b and Fig. 7 at its testbed's scale, and training data for the CV-attention model.

1. Speed: one hour of Gamma arrivals at 50 req/s over QUART Table 1's 5 models x 8 stages on
   12 servers x 4 GPUs under QUART, on one core (target <= 60 s).
2. Calibration: the trace of benchmarks/results/loadgen-cv1 and -cv4 (LLaMA-7B emulated, 20 req/s,
   30 s, seed 4) in the simulator's embedded-runtime preset, 5 simulator seeds, median against
   the measured run of each policy (target: mean within 15 %, p99 within 25 %).
3. Fig. 2a/2b: each model alone on the testbed at 1 replica per stage, the heaviest stage at
   85 % utilisation, entry CV 0.1 and 4: per-stage inter-arrival CV and mean queue length.
4. Fig. 7: all 5 models together at 10 req/s each, entry CV 0.1-8, every policy: mean latency
   and goodput (answers within 2x the model's unloaded latency) per model.
5. CV attention: windows from simulated chains train the model; held-out MAE against the naive
   "the entry CV everywhere" guess."""
from __future__ import annotations

import json
import time

import numpy as np
import torch

from autoscaler.policy.controller import POLICIES
from benchmarks.report import RESULTS, conditions, table, write
from contracts.config import Settings, load_settings
from loadgen.arrivals import gamma_arrivals
from sim.config import embedded_runtime, quart_testbed
from sim.models import table1
from sim.run import simulate, stage_timeline, unloaded_latency
from sim.simulation import Trace
from tools.cv_traces import windows
from tools.train_smoother import evaluate, split, train

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


def _latency(trace: Trace, mask: np.ndarray | None = None) -> tuple[float, float]:
    ok = trace.status == 200
    if mask is not None:
        ok &= mask
    lat = trace.latency[ok]
    return float(lat.mean()), float(np.percentile(lat, 99))


def calibration(seeds: int = 5) -> list[dict]:
    models = table1(["llama-7b"])
    rows = []
    for cv in (1, 4):
        measured = json.loads((RESULTS / f"loadgen-cv{cv}" / "results.json").read_text())
        arrivals = {"llama-7b": gamma_arrivals(20.0, float(cv), 30.0, seed=4)}
        assert measured["runs"]["static"]["summary"]["sent"] == len(arrivals["llama-7b"]), "not the same trace"
        if set(measured["runs"]) != set(POLICIES):
            raise SystemExit(f"loadgen-cv{cv} was measured with other policies ({sorted(measured['runs'])}); "
                             "run `python -m benchmarks loadgen` first")
        for policy in POLICIES:
            sims = [_latency(simulate(embedded_runtime(seed=s), models, arrivals, policy, _settings()))
                    for s in range(seeds)]
            mean, p99 = float(np.median([x[0] for x in sims])), float(np.median([x[1] for x in sims]))
            real = measured["runs"][policy]["summary"]["latency_s"]
            rows.append({"cv": cv, "policy": policy, "real_mean_ms": real["mean"] * 1000, "sim_mean_ms": mean * 1000,
                         "real_p99_ms": real["p99"] * 1000, "sim_p99_ms": p99 * 1000,
                         "sim_mean_range_ms": [min(x[0] for x in sims) * 1000, max(x[0] for x in sims) * 1000],
                         "mean_error": mean * 1000 / (real["mean"] * 1000) - 1,
                         "p99_error": p99 * 1000 / (real["p99"] * 1000) - 1})
    return rows


def fig2(duration: float = 600.0) -> list[dict]:
    rows = []
    for m in table1():
        heaviest = max(range(m.num_stages), key=m.profile.stage_ms)
        rate = 0.85 / (m.profile.stage_ms(heaviest) / 1000.0)
        for cv in (0.1, 4.0):
            cfg = quart_testbed(tail_s=0.0)
            trace = simulate(cfg, [m], {m.name: gamma_arrivals(rate, cv, duration, seed=1)}, "static", _settings())
            t = stage_timeline(trace, cfg, m)
            rows.append({"model": m.name, "entry_cv": cv, "rate": rate, "heaviest": heaviest,
                         "cv": t["cv"], "queue": t["mean_queue"], "longest_queue": int(np.argmax(t["mean_queue"]))})
    return rows


def fig7(duration: float = 600.0) -> list[dict]:
    models = table1()
    rows = []
    for cv in FIG7_CVS:
        arrivals = {m.name: gamma_arrivals(10.0, cv, duration, seed=k + 10) for k, m in enumerate(models)}
        for policy in POLICIES:
            trace = simulate(quart_testbed(), models, arrivals, policy, _settings(), record_arrivals=False)
            for k, m in enumerate(models):
                mine = trace.model_of == k
                ok = mine & (trace.status == 200)
                slo = 2 * unloaded_latency(quart_testbed(), m)
                rows.append({"cv": cv, "policy": policy, "model": m.name,
                             "mean_ms": float(trace.latency[ok].mean()) * 1000,
                             "goodput": float((ok & (trace.latency <= slo)).sum()) / duration,
                             "failed": int((mine & (trace.status != 200)).sum())})
    return rows


def cv_training(traces: int = 48, duration: float = 400.0, window_s: float = 30.0) -> dict:
    rng = np.random.default_rng(7)
    samples = []
    for k in range(traces):
        m = table1()[k % 5]
        replicas = int(rng.integers(1, 4))
        heaviest = max(m.profile.stage_ms(i) for i in range(m.num_stages)) / 1000.0
        rate = float(rng.uniform(0.3, 0.95)) * replicas / heaviest
        cv = float(rng.choice([0.1, 0.5, 1, 2, 4, 8]))
        settings = _settings(policy_params={"replicas": replicas})
        trace = simulate(quart_testbed(seed=k, tail_s=0.0), [m], {m.name: gamma_arrivals(rate, cv, duration, seed=k)},
                         "static", settings)
        means = [m.profile.stage_ms(i) / 1000.0 for i in range(m.num_stages)]
        samples += [{**w, "trace": k} for w in windows(trace.stage_arrivals[m.name], window_s, means,
                                                       [m.profile.cv] * m.num_stages, [replicas] * m.num_stages)]
    fit, held = split(samples, seed=0)
    model = train(fit, epochs=60, seed=0)
    return {"windows": len(samples), "fit": len(fit), "held_out": len(held), **evaluate(model, held)}


def plot(f2: list[dict], f7: list[dict]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
    for col, cv in enumerate((0.1, 4.0)):
        for r in (r for r in f2 if r["entry_cv"] == cv):
            axes[0][col].plot(range(len(r["cv"])), r["cv"], marker="o", label=r["model"])
            axes[1][col].plot(range(len(r["queue"])), r["queue"], marker="o", label=r["model"])
        axes[0][col].set(title=f"Fig. 2a (simulated): inter-arrival CV per stage, entry CV {cv:g}", xlabel="stage")
        axes[1][col].set(title=f"Fig. 2b (simulated): mean queue per stage, entry CV {cv:g}", xlabel="stage",
                         yscale="log")
        for ax in (axes[0][col], axes[1][col]):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / "simulator_fig2.png", dpi=100)
    plt.close(fig)
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    for policy in POLICIES:
        mean = [np.mean([r["mean_ms"] for r in f7 if r["policy"] == policy and r["cv"] == cv]) for cv in FIG7_CVS]
        good = [np.sum([r["goodput"] for r in f7 if r["policy"] == policy and r["cv"] == cv]) for cv in FIG7_CVS]
        a.plot(FIG7_CVS, mean, marker="o", label=policy)
        b.plot(FIG7_CVS, good, marker="o", label=policy)
    a.set(title="Fig. 7a (simulated): mean latency, average over 5 models", xlabel="entry CV", ylabel="ms",
          xscale="log", yscale="log")
    b.set(title="Fig. 7b (simulated): goodput, 5 models together", xlabel="entry CV", ylabel="req/s within 2x",
          xscale="log")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / "simulator_fig7.png", dpi=100)
    plt.close(fig)


def main() -> dict:
    torch.set_num_threads(1)
    s = speed()
    print(table("Speed: 1 h at 50 req/s, 5 models x 8 stages, 12 x 4 GPUs, QUART, one core",
                ["wall s", "CPU s", "requests", "answered", "events", "decisions", "forks", "cold"],
                [[round(s["wall_s"], 1), round(s["cpu_s"], 1), s["requests"], s["ok"], s["events"], s["decisions"],
                  s["fork"], s["cold"]]]))
    cal = calibration()
    print(table("Calibration: embedded runtime (measured) vs simulator (median of 5 seeds), LLaMA-7B emulated, 20 req/s, 30 s",
                ["CV", "policy", "real mean", "sim mean", "error", "real p99", "sim p99", "error"],
                [[r["cv"], r["policy"], round(r["real_mean_ms"]), round(r["sim_mean_ms"]), f"{100 * r['mean_error']:+.0f} %",
                  round(r["real_p99_ms"]), round(r["sim_p99_ms"]), f"{100 * r['p99_error']:+.0f} %"] for r in cal]))
    f2 = fig2()
    print(table("Fig. 2a/2b: static, 1 replica per stage, heaviest stage (3) at 85 % utilisation",
                ["model", "entry CV", "CV per stage", "mean queue per stage", "longest queue"],
                [[r["model"], r["entry_cv"], " ".join(f"{c:.2f}" for c in r["cv"]),
                  " ".join(f"{q:.1f}" for q in r["queue"]), r["longest_queue"]] for r in f2]))
    f7 = fig7()
    rows = []
    for cv in FIG7_CVS:
        for policy in POLICIES:
            mine = [r for r in f7 if r["cv"] == cv and r["policy"] == policy]
            rows.append([cv, policy, round(float(np.mean([r["mean_ms"] for r in mine]))),
                         round(float(np.sum([r["goodput"] for r in mine])), 2), sum(r["failed"] for r in mine)])
    print(table("Fig. 7: 5 models together, 10 req/s each, 600 s; mean latency averaged over models, goodput summed",
                ["entry CV", "policy", "mean ms", "goodput req/s", "failed"], rows))
    cvm = cv_training()
    print(table(f"CV attention trained on simulated windows ({cvm['fit']} fit, {cvm['held_out']} held out by trace)",
                ["stage", "model MAE", "naive MAE"],
                [[i, m, n] for i, (m, n) in enumerate(zip(cvm["model_mae"], cvm["naive_mae"]))]))
    plot(f2, f7)
    figures = [{"name": "simulate 1 h at 50 req/s, 5 models x 8 stages, 48 GPUs (wall)", "value": round(s["wall_s"], 2), "unit": "s"},
               {"name": "simulate 1 h at 50 req/s (CPU)", "value": round(s["cpu_s"], 2), "unit": "s"},
               {"name": "simulated events in 1 h", "value": s["events"], "unit": "events"}]
    figures += [{"name": f"calibration cv{r['cv']} {r['policy']} {k}", "value": round(r[k], 4 if "error" in k else 1),
                 "unit": "fraction" if "error" in k else "ms"}
                for r in cal for k in ("real_mean_ms", "sim_mean_ms", "mean_error", "real_p99_ms", "sim_p99_ms", "p99_error")]
    figures += [{"name": f"fig2 {r['model']} cv{r['entry_cv']:g} longest queue stage", "value": r["longest_queue"], "unit": "stage",
                 "cv_per_stage": [round(c, 3) for c in r["cv"]], "mean_queue_per_stage": [round(q, 2) for q in r["queue"]]}
                for r in f2]
    figures += [{"name": f"fig7 cv{r[0]:g} {r[1]} mean latency (model average)", "value": r[2], "unit": "ms"} for r in rows]
    figures += [{"name": f"fig7 cv{r[0]:g} {r[1]} goodput (5 models)", "value": r[3], "unit": "req/s"} for r in rows]
    figures += [{"name": f"cv attention held-out MAE stage {i}", "value": m, "unit": "CV", "naive": n}
                for i, (m, n) in enumerate(zip(cvm["model_mae"], cvm["naive_mae"]))]
    write("simulator", figures, conditions(speed_models=5, speed_rate_rps=50, speed_seconds=3600, calibration_seeds=5,
                                           calibration_against="benchmarks/results/loadgen-cv1, loadgen-cv4 (measured 2026-11-21)",
                                           fig2_seconds=600, fig7_seconds=600, fig7_rate_per_model=10,
                                           cv_training_windows=cvm["windows"], plots="simulator_fig2.png, simulator_fig7.png"))
    return {"speed": s, "calibration": cal, "fig2": f2, "fig7": f7, "cv": cvm}


if __name__ == "__main__":
    main()
