"""One tick of the full QUART policy (corrector, smoother with a trained CV-attention model, CPU
compensator) for 1,000 pipelines of 8 stages, from observed states to decisions, on one core.
Target: 100 ms. Also the trained CV model's held-out error per stage against the naive baseline
(every stage's CV = the entry CV), on tandem-queue traces (autoscaler/cv_traces.py)."""
from __future__ import annotations

import gc
import time

import numpy as np
import torch

from autoscaler.policy.compensator import Compensator, CPUFit
from autoscaler.policy.corrector import Corrector
from autoscaler.policy.quart import Quart
from autoscaler.policy.smoother import Smoother
from autoscaler.policy.state import PipelineState, StageState
from benchmarks.report import conditions, table, write
from tools.cv_traces import synthetic
from tools.train_smoother import evaluate, split, train


def random_states(count: int, stages: int, seed: int) -> list[PipelineState]:
    rng = np.random.default_rng(seed)
    states = []
    for p in range(count):
        rate = rng.uniform(1, 50)
        states.append(PipelineState(f"m{p}", tuple(
            StageState(stage=i, arrival_rate=rate, service_time_s=rng.uniform(0.005, 0.2),
                       replicas=int(rng.integers(1, 8)), arrival_cv=float(rng.uniform(0.1, 8)),
                       queue_length=int(rng.integers(0, 50)), payload=float(rng.integers(16, 512)))
            for i in range(stages)), slo_s=2.0, entry_rate=rate))
    return states


def main(pipelines: int = 1000, stages: int = 8, repeats: int = 5) -> dict:
    torch.set_num_threads(1)
    samples = synthetic(400, seed=11)
    fit, held = split(samples, seed=11)
    t0 = time.perf_counter()
    model = train(fit, epochs=20, seed=11)
    train_s = time.perf_counter() - t0
    accuracy = evaluate(model, held)
    policy = Quart(Corrector(), Smoother(model),
                   Compensator({i: CPUFit(0.002, 0.02, 0.0001) for i in range(stages)}, cpu_max=8))
    states = random_states(pipelines, stages, seed=5)
    memories: dict[str, object] = {}
    # As the live loop does once it is set up (autoscaler/loop.py).
    gc.collect()
    gc.freeze()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        results = policy.decide_many(states, [memories.get(s.model) for s in states])
        times.append((time.perf_counter() - t0) * 1000.0)
        memories = {s.model: memory for s, (_, memory) in zip(states, results)}
    tick_ms = float(np.median(times))
    print(table(f"One QUART tick, {pipelines} pipelines x {stages} stages, one core (ms)",
                ["median ms", "min ms", "target ms"], [[round(tick_ms, 1), round(min(times), 1), 100]]))
    rows = [[i, m, n] for i, (m, n) in enumerate(zip(accuracy["model_mae"], accuracy["naive_mae"]))]
    print(table(f"CV-attention model, held-out MAE of the arrival CV per stage ({len(held)} windows "
                f"from unseen traces)", ["stage", "model", "naive (entry CV)"], rows))
    figures = [{"name": "QUART tick median", "value": round(tick_ms, 2), "unit": "ms",
                "pipelines": pipelines, "stages": stages},
               {"name": "QUART tick min", "value": round(min(times), 2), "unit": "ms"},
               {"name": "CV model training time", "value": round(train_s, 1), "unit": "s"}]
    figures += [{"name": f"CV MAE stage {i} model", "value": m, "unit": "CV"} for i, m, _ in rows]
    figures += [{"name": f"CV MAE stage {i} naive", "value": n, "unit": "CV"} for i, _, n in rows]
    write("autoscaler_tick", figures, conditions(
        repeats=repeats, threads=1, training_windows=len(fit), held_out_windows=len(held),
        traces="tandem-queue model, entry CV 0.1-8, 60 s windows"))
    return {"tick_ms": tick_ms, "accuracy": accuracy}


if __name__ == "__main__":
    main()
