"""QUART's corrector (§5.1): per stage, a PID controller on the error between the stage's delay
and its share of the SLO, which adds replicas fast and removes them slowly.

QUART writes e(t) = T_target − T_i and r' = r + Δr, which would remove replicas from a stage that
is over its target. The sign used here adds replicas when the delay is over target:
e = (T − T_target) / T_target, a dimensionless error, so the gains are in replicas per unit of
relative error.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from autoscaler.policy.queueing import allen_cunneen_wait
from autoscaler.policy.state import Decision, PipelineState, StageDecision, StageState
from contracts.config import Bounds

# An unstable stage (λ ≥ c·μ) has an infinite predicted delay: its error is capped here, and
# the replicas it needs to be stable at all are added at once.
MAX_ERROR = 10.0


@dataclass(frozen=True)
class PIDConfig:
    kp: float = 0.5
    ki: float = 0.1
    kd: float = 0.1
    period_s: float = 1.0            # the controller's fixed period
    integral_limit: float = 5.0      # anti-windup: |∫e| never exceeds this
    max_up: int = 4                  # replicas added in one tick at most
    max_down: int = 1                # replicas removed in one tick at most
    down_band: float = 0.3           # scale down only when the delay is this far under target
    down_ticks: int = 5              # ... for this many consecutive ticks


@dataclass(frozen=True, slots=True)
class PIDMemory:
    integral: float = 0.0
    last_delay: float | None = None
    below_ticks: int = 0


@dataclass(frozen=True)
class CorrectorMemory:
    stages: tuple[PIDMemory, ...] = ()


def stage_targets(state: PipelineState) -> list[float]:
    """Each stage's delay target: the SLO split in proportion to the service times along the
    heaviest path through the stage (in a chain, all stages)."""
    known = all(s.service_time_s > 0 for s in state.stages)
    # A stage that has not served anything yet has no known service time: count stages instead.
    weights = [s.service_time_s if known else 1.0 for s in state.stages]
    return [state.slo_s * w / length for w, length in zip(weights, state.path_lengths(weights))]


def stage_delay(s: StageState) -> float:
    """The larger of the modelled sojourn (Allen–Cunneen with the observed CVs, plus draining the
    backlog already queued) and the measured one."""
    mu = s.service_rate
    wait = allen_cunneen_wait(s.arrival_rate, mu, s.replicas, s.arrival_cv ** 2, s.service_cv ** 2)
    if s.replicas > 0 and math.isfinite(wait):
        wait += s.queue_length / (s.replicas * mu)
    return max(wait + s.service_time_s, s.latency_s)


def pid_step(cfg: PIDConfig, mem: PIDMemory, delay: float, target: float,
             replicas: int, bounds: Bounds = Bounds()) -> tuple[int, PIDMemory, dict]:
    """One controller period for one stage: new replica count, new memory, and the terms."""
    measured = min(delay, target * (1 + MAX_ERROR))  # an infinite delay counts as MAX_ERROR
    error = (measured - target) / target
    # Derivative on the measurement, not the error: a change of target does not kick it.
    previous = measured if mem.last_delay is None else mem.last_delay
    derivative = (measured - previous) / target / cfg.period_s
    integral = mem.integral + error * cfg.period_s
    raw = cfg.kp * error + cfg.ki * integral + cfg.kd * derivative
    wanted = replicas + raw
    # Anti-windup: the integral stops growing while the output is pinned at a bound.
    if (wanted > bounds.r_max and error > 0) or (wanted < bounds.r_min and error < 0):
        integral = mem.integral
    integral = max(-cfg.integral_limit, min(cfg.integral_limit, integral))
    below = mem.below_ticks + 1 if error < -cfg.down_band else 0
    if raw > 0 and error > 0:
        new = replicas + min(cfg.max_up, math.ceil(raw))
    elif raw < 0 and below >= cfg.down_ticks:
        new = replicas - min(cfg.max_down, math.ceil(-raw))
    else:
        new = replicas
    new = bounds.clamp(new)
    terms = {"target_s": target, "error": error, "p": cfg.kp * error, "i": cfg.ki * integral, "d": cfg.kd * derivative,
             "below_ticks": below}
    return new, PIDMemory(integral, measured, below), terms


def _stability_floor(s: StageState) -> int:
    """Replicas without which the stage's queue grows without bound."""
    return math.floor(s.arrival_rate * s.service_time_s) + 1 if s.arrival_rate > 0 else 0


@dataclass(frozen=True)
class Corrector:
    config: PIDConfig = field(default_factory=PIDConfig)
    name: str = "quart-corrector"

    def decide(self, state: PipelineState, memory: CorrectorMemory | None = None) -> tuple[Decision, CorrectorMemory]:
        mems = list(memory.stages) if memory and len(memory.stages) == len(state.stages) \
            else [PIDMemory()] * len(state.stages)
        targets = stage_targets(state)
        delays = [stage_delay(s) for s in state.stages]
        longest_queue = max(range(len(state.stages)), key=lambda i: state.stages[i].queue_length)
        decisions, new_mems = [], []
        for s, target, delay, mem in zip(state.stages, targets, delays, mems):
            replicas, new_mem, terms = pid_step(self.config, mem, delay, target, s.replicas, state.bounds)
            if s.scaling_up and replicas > s.replicas:
                # The last scale-up has not taken effect yet: wait for it instead of piling more
                # on, and do not let the integral wind up meanwhile.
                replicas, new_mem = s.replicas, PIDMemory(mem.integral, new_mem.last_delay, 0)
                terms["waiting_for_replicas"] = s.replicas - (s.ready_replicas or 0)
            mem = new_mem
            # Fast scale-up: an unstable stage gets the replicas that make it stable at once.
            replicas = min(state.bounds.r_max, max(replicas, _stability_floor(s)))
            key = delay > target or (s.queue_length > 0 and s.stage == state.stages[longest_queue].stage)
            terms.update({"lambda": s.arrival_rate, "mu": s.service_rate, "predicted_delay_s": delay,
                          "target_s": target})
            decisions.append(StageDecision(s.stage, replicas, s.cpus, key, terms))
            new_mems.append(mem)
        return Decision(state.model, self.name, tuple(decisions)), CorrectorMemory(tuple(new_mems))

