"""Replicas that would add no capacity are not added. A stage replica computes on the host's
cores; on a host with no idle core a new one only takes cycles from those already there (seen on
2 cores: SmolLM2 stages at 16 replicas each served 3.4 items/s per replica, down from 31, and the
M/M/c model read the slowdown as a need for still more). So while less than MIN_FREE_CORES of the
CPU the model's replicas run on is idle, no stage gets more replicas than it has; scale-downs, CPU
changes and key stages go ahead. Applies to every policy, after it decides. Pure."""
from __future__ import annotations

from dataclasses import replace

from autoscaler.policy.state import Decision, PipelineState

MIN_FREE_CORES = 0.5


def hold_without_cpu(state: PipelineState, decision: Decision) -> Decision:
    if state.cpu_free is None or state.cpu_free >= MIN_FREE_CORES:
        return decision
    held = tuple(replace(d, replicas=max(s.replicas, state.bounds.r_min), reason={**d.reason, "held": f"{state.cpu_free:.2f} cores idle"})
                 if d.replicas > s.replicas else d for s, d in zip(state.stages, decision.stages))
    return replace(decision, stages=held)
