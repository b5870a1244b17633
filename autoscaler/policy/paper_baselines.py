"""The baselines QUART's evaluation compares against, each from its own paper's mechanism and
applied per stage function (QUART §8: "at stage granularity"): INFless, Cocktail and InferLine.
Pure, behind the same interface as every policy: `decide(state, memory) -> (Decision, memory)`.

What each does not do here, and why: the emulated stages compute one item at a time, so INFless's
batch choice is always 1 (its resource-efficient configuration: one CPU, which under Amdahl's law
gives the most throughput per CPU); Cocktail's model ensembling has no counterpart in a pipeline
of one model (its autoscaler is what is compared); InferLine's planner searches configurations
with its own simulator, and the Allen–Cunneen estimate of the same delay stands in for it."""
from __future__ import annotations

import math
from dataclasses import dataclass

from autoscaler.policy.contract import Reactive
from autoscaler.policy.corrector import stage_targets
from autoscaler.policy.queueing import min_servers
from autoscaler.policy.state import Decision, PipelineState


def hold_down(want: int, current: int, below_since: float | None, now: float,
              delay_s: float) -> tuple[int, float | None]:
    """Scale up at once; scale down to `want` only after it has stayed below `current` for
    `delay_s`. Returns (replicas, since when the want has been lower)."""
    if want >= current:
        return want, None
    since = now if below_since is None else below_since
    return (want, None) if now - since >= delay_s else (current, since)


def _per_stage(memory: tuple | None, n: int, empty: object) -> list:
    return list(memory) if memory is not None and len(memory) == n else [empty] * n


@dataclass(frozen=True)
class INFless(Reactive):
    """INFless (ASPLOS '22), reactive on RPS: an instance runs at the configuration with the most
    throughput per resource that meets the stage's share of the SLO; its max RPS, r_max, is the
    rate at which its M/M/1 sojourn 1 / (μ − λ) equals that share; a stage gets
    ceil(RPS / r_max) instances. Instances beyond that are released after `keep_alive_s`
    (INFless's long-short-term histogram predicts the keep-alive per function; a fixed one here)."""
    keep_alive_s: float = 60.0
    name: str = "infless"

    def decide(self, state: PipelineState, memory: tuple | None = None, predicted: None = None) -> tuple[Decision, tuple]:
        since = _per_stage(memory, len(state.stages), None)
        replicas, reasons = [], []
        for i, (s, target) in enumerate(zip(state.stages, stage_targets(state))):
            mu = s.service_rate
            r_max = mu - 1.0 / target if math.isfinite(mu) and target * mu > 1 else 0.5 * mu
            want = state.bounds.clamp(math.ceil(s.arrival_rate / r_max) if math.isfinite(r_max) else s.replicas)
            n, since[i] = hold_down(want, s.replicas, since[i], state.now, self.keep_alive_s)
            replicas.append(n)
            reasons.append({"rps": s.arrival_rate, "r_max": r_max, "want": want})
        return Decision.of(state, self.name, replicas, reasons), tuple(since)


@dataclass(frozen=True)
class HoltMemory:
    level: float
    trend: float
    t: float
    below_since: float | None = None


@dataclass(frozen=True)
class Cocktail(Reactive):
    """Cocktail (NSDI '22), proactive with a reactive floor: each stage's request rate is
    forecast `horizon_s` ahead (about a cold start, so replicas are up when the load arrives)
    and provisioned for: ceil(max(rate now, forecast) × service / target utilisation). Cocktail
    forecasts with a learned model (DeepAR); Holt's double exponential smoothing (level and trend,
    no training) stands in. Surplus goes after `cooldown_s`."""
    alpha: float = 0.5
    beta: float = 0.3
    horizon_s: float = 5.0
    target_utilization: float = 0.8
    cooldown_s: float = 30.0
    name: str = "cocktail"

    def decide(self, state: PipelineState, memory: tuple | None = None, predicted: None = None) -> tuple[Decision, tuple]:
        mems = _per_stage(memory, len(state.stages), None)
        replicas, reasons = [], []
        for i, s in enumerate(state.stages):
            mem = self._forecaster(mems[i], s.arrival_rate, state.now)
            forecast = max(0.0, mem.level + mem.trend * self.horizon_s)
            rate = max(s.arrival_rate, forecast)
            want = state.bounds.clamp(math.ceil(rate * s.service_time_s / self.target_utilization))
            n, below = hold_down(want, s.replicas, mem.below_since, state.now, self.cooldown_s)
            mems[i] = HoltMemory(mem.level, mem.trend, mem.t, below)
            replicas.append(n)
            reasons.append({"rps": s.arrival_rate, "forecast_rps": forecast, "want": want})
        return Decision.of(state, self.name, replicas, reasons), tuple(mems)

    def _forecaster(self, mem: HoltMemory | None, rate: float, now: float) -> HoltMemory:
        """Holt's update with the trend per second (ticks need not be evenly spaced)."""
        if mem is None:
            return HoltMemory(rate, 0.0, now)
        dt = max(now - mem.t, 1e-9)
        level = self.alpha * rate + (1 - self.alpha) * (mem.level + mem.trend * dt)
        trend = self.beta * (level - mem.level) / dt + (1 - self.beta) * mem.trend
        return HoltMemory(level, trend, now, mem.below_since)


@dataclass(frozen=True)
class InferLine(Reactive):
    """InferLine (SoCC '20): a planner and a high-frequency tuner. The planner sizes each stage
    for a planning sample (`plan_rps` at `plan_cv`): the fewest replicas whose G/G/c delay meets
    the stage's share of the SLO; with no sample (`plan_rps` 0) the plan is the minimum. The tuner
    watches the traffic envelope (the highest arrival rate over 1 s and over the window): where it
    exceeds what the stage's replicas serve at `target_utilization`, the stage is sized for it at
    once; below, replicas return towards the plan only after `downscale_delay_s`."""
    plan_rps: float = 0.0
    plan_cv: float = 1.0
    target_utilization: float = 1.0
    downscale_delay_s: float = 30.0
    name: str = "inferline"

    def decide(self, state: PipelineState, memory: tuple | None = None, predicted: None = None) -> tuple[Decision, tuple]:
        since = _per_stage(memory, len(state.stages), None)
        replicas, reasons = [], []
        for i, (s, target) in enumerate(zip(state.stages, stage_targets(state))):
            plan = self._plan(s.service_time_s, target)
            envelope = max(s.peak_rate, s.arrival_rate)
            tuned = math.ceil(envelope * s.service_time_s / self.target_utilization)
            want = state.bounds.clamp(max(plan, tuned))
            n, since[i] = hold_down(want, s.replicas, since[i], state.now, self.downscale_delay_s)
            replicas.append(n)
            reasons.append({"envelope_rps": envelope, "plan": plan, "tuned": tuned})
        return Decision.of(state, self.name, replicas, reasons), tuple(since)

    def _plan(self, service_s: float, target_s: float) -> int:
        if self.plan_rps <= 0 or service_s <= 0:
            return 0
        return min_servers(self.plan_rps, 1.0 / service_s, max(1e-6, target_s - service_s),
                           self.plan_cv ** 2, 1.0)
