"""A request alone in a simulated pipeline: what the latency objectives and goodput are
multiples of."""
from __future__ import annotations

import numpy as np

from sim.config import SimConfig
from sim.generation import hop_s
from sim.models import GenerativeModel, SimModel

AnyModel = SimModel | GenerativeModel


def unloaded_generation(cfg: SimConfig, model: GenerativeModel) -> tuple[float, float]:
    """(TTFT, TPOT) of a request alone, its prompt the calibration's median: the entry, every
    stage's step and every hop; the entry again per token."""
    cal = model.calibration
    prompt = int(np.median(cal.prompt_tokens))
    ttft = cfg.entry_s + sum(c.batch_s([(prompt, 0)]) + hop_s(cfg, cal, prompt) for c in cal.stages)
    context = prompt + model.new_tokens // 2
    tpot = cfg.entry_s / 2 + sum(c.batch_s([(1, context)]) for c in cal.stages) + (len(cal.stages) + 1) * hop_s(cfg, cal, 1)
    return ttft, tpot


def unloaded_latency(cfg: SimConfig, model: AnyModel) -> float:
    """A request alone in the pipeline: the entry, and every stage's mean service and hop on its
    critical path (every stage, in a chain)."""
    if isinstance(model, GenerativeModel):
        ttft, tpot = unloaded_generation(cfg, model)
        return ttft + (model.new_tokens - 1) * tpot
    p = model.profile
    hop = cfg.hop(model.activation_bytes)
    return cfg.entry_s + sum(p.stage_ms(i) / 1000.0 + cfg.service_overhead_s + hop for i in model.critical_path())
