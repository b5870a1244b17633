"""Runs the simulator the way the load generator runs the real system: one schedule, one run per
policy, and the load generator's summary, timelines and report for each."""
from __future__ import annotations

import numpy as np

from contracts.config import Settings
from loadgen.metrics import summarize
from loadgen.timeline import Sampler, timeline
from sim.config import SimConfig
from sim.models import SimModel
from sim.simulation import Simulation, Trace


def simulate(cfg: SimConfig, models: list[SimModel], arrivals: dict[str, np.ndarray], policy: str,
             settings: Settings | None = None, record_arrivals: bool = True) -> Trace:
    return Simulation(cfg, models, arrivals, policy, settings, record_arrivals=record_arrivals).run()


def unloaded_latency(cfg: SimConfig, model: SimModel) -> float:
    """A request alone in the pipeline: the entry, every stage's mean service and every hop."""
    p = model.profile
    hop = cfg.hop(model.activation_bytes)
    return cfg.entry_s + sum(p.stage_ms(i) / 1000.0 + cfg.service_overhead_s + hop for i in range(model.num_stages))


def replica_seconds(trace: Trace, period_s: float) -> float:
    return float(sum(sum(sum(row) for row in s["replicas"]) for s in trace.samples.values()) * period_s)


def stage_timeline(trace: Trace, cfg: SimConfig, model: SimModel) -> dict:
    """The load generator's timeline of one model: replicas and queue per sample, arrival rate,
    inter-arrival CV and mean queue per stage."""
    s = trace.samples[model.name]
    sampler = Sampler(None, model.name, model.num_stages, cfg.sample_s,
                      samples=list(zip(s["t"], s["replicas"], s["queue"])))
    return timeline(sampler, trace.stage_arrivals[model.name], 0.0)


def report_run(trace: Trace, cfg: SimConfig, models: list[SimModel], detail: bool = True) -> dict:
    """One run in the shape `loadgen.report.write` takes. The timeline is the first model's (as
    a replay's); the profiled latency is the first model's unloaded latency."""
    first = models[0]
    records = trace.records(detail)
    duration = float(trace.sent.max()) if len(trace.sent) else 1.0
    return {"summary": summarize(records, unloaded_latency(cfg, first), duration or 1.0,
                                 replica_seconds(trace, cfg.sample_s)),
            "timeline": stage_timeline(trace, cfg, first), "records": records}
