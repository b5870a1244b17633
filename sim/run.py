"""Runs the simulator the way the load generator runs the real system: one schedule, one run per
policy, and the load generator's summary, timelines and report for each."""
from __future__ import annotations

import numpy as np

from contracts.config import Settings
from loadgen.metrics import summarize
from loadgen.timeline import Sampler, timeline
from sim.config import SimConfig
from sim.models import GenerativeModel, SimModel
from sim.simulation import Simulation, Trace
from sim.unloaded import unloaded_generation, unloaded_latency

AnyModel = SimModel | GenerativeModel


def simulate(cfg: SimConfig, models: list[AnyModel], arrivals: dict[str, np.ndarray], policy: str,
             settings: Settings | None = None, record_arrivals: bool = True) -> Trace:
    return Simulation(cfg, models, arrivals, policy, settings, record_arrivals=record_arrivals).run()


def replica_seconds(trace: Trace, period_s: float) -> float:
    return float(sum(sum(sum(row) for row in s["replicas"]) for s in trace.samples.values()) * period_s)


def stage_timeline(trace: Trace, cfg: SimConfig, model: AnyModel) -> dict:
    """The load generator's timeline of one model: replicas and queue per sample, arrival rate,
    inter-arrival CV and mean queue per stage."""
    s = trace.samples[model.name]
    sampler = Sampler(None, model.name, model.num_stages, cfg.sample_s,
                      samples=list(zip(s["t"], s["replicas"], s["queue"])))
    return timeline(sampler, trace.stage_arrivals[model.name], 0.0)


def report_run(trace: Trace, cfg: SimConfig, models: list[AnyModel], detail: bool = True) -> dict:
    """One run in the shape `loadgen.report.write` takes. The timeline is the first model's (as
    a replay's); the profiled latency is the first model's unloaded latency. A generative first
    model adds the token metrics, with the load generator's SLOs: TTFT 5x and TPOT 2x unloaded."""
    first = models[0]
    records = trace.records(detail)
    duration = float(trace.sent.max()) if len(trace.sent) else 1.0
    tokens = {}
    if isinstance(first, GenerativeModel):
        ttft, tpot = unloaded_generation(cfg, first)
        tokens = {"warm_ttft_s": ttft, "tpot_slo_s": 2.0 * tpot}
    return {"summary": summarize(records, unloaded_latency(cfg, first), duration or 1.0,
                                 replica_seconds(trace, cfg.sample_s), **tokens),
            "timeline": stage_timeline(trace, cfg, first), "records": records}
