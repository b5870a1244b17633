"""One tick of the full QUART policy (corrector, smoother with a trained CV-attention model, CPU
compensator) for 1,000 pipelines of 8 stages, on one core, through the path the live loop and the
simulator run: `Controller.step` (batched CV prediction, bounds, actions, records). Target: 100 ms.
Then the whole live tick: the Observer's Redis reads of every stage (records, stream,
backlog, replicas) from a real redis-server holding a window of records, plus the step.
Also the trained CV model's held-out error per stage against the naive baseline (every stage's
CV = the entry CV), on tandem-queue traces (tools/cv_traces.py)."""
from __future__ import annotations

import gc
import time

import numpy as np
import torch

from autoscaler.observe import Observer
from autoscaler.policy.compensator import Compensator, CPUFit
from autoscaler.policy.controller import Controller
from autoscaler.policy.corrector import Corrector
from autoscaler.policy.quart import Quart
from autoscaler.policy.smoother import Smoother
from autoscaler.policy.state import PipelineState, StageState
from benchmarks.report import conditions, mean_ci95, table, verdict, write
from contracts.stage import StageRef
from state import keys
from state.records import ReplicaRecord, StageSample
from state.store import RedisStore
from tools.cv_traces import synthetic
from tools.train_smoother import evaluate, split, train

MEASURES = ("autoscaler", "state", "contracts")  # the code measured (benchmarks/freshness.py)


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


TARGET_MS = 100.0  # one tick of 1,000 pipelines x 8 stages


def main(pipelines: int = 1000, stages: int = 8, repeats: int = 9) -> dict:
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
    refs = {s.model: tuple(StageRef(s.model, i, i + 1) for i in range(stages)) for s in states}
    controller = Controller(refs, {m: policy for m in refs})
    observations = {s.model: s for s in states}
    # As the live loop does once it is set up (autoscaler/loop.py).
    gc.collect()
    gc.freeze()
    times = []
    for k in range(repeats):
        t0 = time.perf_counter()
        controller.step(float(k), observations)
        times.append((time.perf_counter() - t0) * 1000.0)
    tick_ms = float(np.median(times))
    mean, half = mean_ci95(times)
    outcome = verdict(mean, half, TARGET_MS)
    live = live_tick(controller, refs, repeats)
    print(table(f"One QUART tick, {pipelines} pipelines x {stages} stages, one core (ms; {repeats} ticks)",
                ["path", "median ms", "min ms", "mean, 95 % interval", "target ms", "verdict"],
                [["Controller.step", round(tick_ms, 1), round(min(times), 1),
                  f"{mean:.1f} ({mean - half:.1f}..{mean + half:.1f})", TARGET_MS, outcome],
                 ["Redis reads (one round trip)", round(live["observe_ms"], 1), round(live["observe_min_ms"], 1),
                  "-", "-", "-"],
                 ["live tick: reads + step", round(live["tick_ms"], 1), round(live["tick_min_ms"], 1), "-", "-", "-"]]))
    rows = [[i, m, n] for i, (m, n) in enumerate(zip(accuracy["model_mae"], accuracy["naive_mae"]))]
    print(table(f"CV-attention model, held-out MAE of the arrival CV per stage ({len(held)} windows "
                f"from unseen traces)", ["stage", "model", "naive (entry CV)"], rows))
    figures = [{"name": "QUART tick median (Controller.step)", "value": round(tick_ms, 2), "unit": "ms",
                "pipelines": pipelines, "stages": stages},
               {"name": "QUART tick min (Controller.step)", "value": round(min(times), 2), "unit": "ms"},
               {"name": "QUART tick mean (Controller.step)", "value": round(mean, 2), "unit": "ms",
                "ci95": [round(mean - half, 2), round(mean + half, 2)], "target": TARGET_MS, "verdict": outcome,
                "per_tick": [round(t, 2) for t in times]},
               {"name": "Observer reads median (Redis)", "value": round(live["observe_ms"], 2), "unit": "ms",
                "records_per_stage_in_window": live["records_per_stage"], "new_records_per_stage_per_tick": live["new_per_tick"]},
               {"name": "live tick median (reads + step)", "value": round(live["tick_ms"], 2), "unit": "ms"},
               {"name": "CV model training time", "value": round(train_s, 1), "unit": "s"}]
    figures += [{"name": f"CV MAE stage {i} model", "value": m, "unit": "CV"} for i, m, _ in rows]
    figures += [{"name": f"CV MAE stage {i} naive", "value": n, "unit": "CV"} for i, _, n in rows]
    write("autoscaler_tick", figures, conditions(
        repeats=repeats, threads=1, training_windows=len(fit), held_out_windows=len(held),
        traces="tandem-queue model, entry CV 0.1-8, 60 s windows"))
    return {"tick_ms": tick_ms, "accuracy": accuracy}


def _add_records(pipe, refs: dict[str, tuple[StageRef, ...]], times: list[float]) -> None:
    for stages in refs.values():
        for ref in stages:
            for t_k in times:
                pipe.xadd(keys.records_stream(ref.model, ref.first),
                          StageSample("bench.0", t_k, 3.0, 40.0, "bench", "pass").encode(), id=f"{int(t_k * 1000)}-0")


def live_tick(controller: Controller, refs: dict[str, tuple[StageRef, ...]], repeats: int,
              per_tick: int = 2, window_s: float = 10.0) -> dict:
    """The live loop's tick against a real redis-server: every stage holds a window of records
    (`per_tick` a second) and a registered replica; each tick `per_tick` new records arrive per
    stage, the Observer reads what is new (one round trip: a script per chunk of stages), then the step runs."""
    import tempfile
    from pathlib import Path

    import redis

    from runtime.ports import free_port
    from runtime.redis_server import start_redis
    port, start = free_port(), time.time()
    with tempfile.TemporaryDirectory() as tmp:
        proc = start_redis("127.0.0.1", port, Path(tmp), Path(tmp) / "redis.log")
        try:
            r = redis.Redis(port=port)
            store = RedisStore(r)
            pipe = r.pipeline(transaction=False)
            _add_records(pipe, refs, [start - window_s + k / per_tick for k in range(int(window_s * per_tick))])
            for stages in refs.values():
                for ref in stages:
                    store.register(ReplicaRecord(f"{ref.model}-s{ref.stages}.bench.1", ref.model, ref.first, ref.last,
                                                 "bench", 1), ttl_s=3600)
            pipe.execute()
            observer = Observer(store, refs, window_s=window_s)
            desired = {m: [1] * len(s) for m, s in refs.items()}
            observer.observe(start, desired, 2.0)  # the first tick reads the whole window
            reads, ticks = [], []
            for k in range(1, repeats + 1):
                now = start + k
                pipe = r.pipeline(transaction=False)
                _add_records(pipe, refs, [now - 1 + j / per_tick for j in range(per_tick)])
                pipe.execute()
                t0 = time.perf_counter()
                observations = observer.observe(now, desired, 2.0)
                t1 = time.perf_counter()
                controller.step(now, observations)
                reads.append((t1 - t0) * 1000.0)
                ticks.append((time.perf_counter() - t0) * 1000.0)
        finally:
            proc.terminate()
            proc.wait()
    return {"observe_ms": float(np.median(reads)), "observe_min_ms": min(reads), "tick_ms": float(np.median(ticks)),
            "tick_min_ms": min(ticks), "records_per_stage": int(window_s * per_tick), "new_per_tick": per_tick}


if __name__ == "__main__":
    main()
