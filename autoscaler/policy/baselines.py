"""Baseline scaling policies behind the same interface as QUART's: `decide(state, memory)`
returns `(Decision, memory)`, pure. Each follows the published rule of the system it stands for:
the serverless platforms' autoscalers here, the systems QUART's paper compares against in
autoscaler/policy/paper_baselines.py; BASELINES names them all.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from autoscaler.policy.contract import Reactive
from autoscaler.policy.paper_baselines import Cocktail, InferLine, INFless
from autoscaler.policy.state import Decision, PipelineState, StageState


def _clamp(value: int, low: int, high: int) -> int:
    return max(low, min(high, value))


@dataclass(frozen=True)
class Static(Reactive):
    """Fixed replicas per stage, whatever the load."""
    replicas: int = 1
    name: str = "static"

    def decide(self, state: PipelineState, memory: object = None, predicted: None = None) -> tuple[Decision, object]:
        n = len(state.stages)
        return Decision.of(state, self.name, [self.replicas] * n, [{"static": self.replicas}] * n), memory


@dataclass(frozen=True)
class OpenFaaSPro(Reactive):
    """OpenFaaS Pro's autoscaler in rps mode, per function (stage):
    replicas = ceil(current rps / (target rps per replica × target proportion)). Defaults are
    OpenFaaS Pro's (com.openfaas.scale.target 50, target-proportion 0.9)."""
    target_rps: float = 50.0
    target_proportion: float = 0.9
    name: str = "openfaas-pro-rps"

    def decide(self, state: PipelineState, memory: object = None, predicted: None = None) -> tuple[Decision, object]:
        replicas = [state.bounds.clamp(math.ceil(s.arrival_rate / (self.target_rps * self.target_proportion)))
                    for s in state.stages]
        reasons = [{"rps": round(s.arrival_rate, 4), "target_rps": self.target_rps} for s in state.stages]
        return Decision.of(state, self.name, replicas, reasons), memory


@dataclass(frozen=True)
class KPAMemory:
    samples: tuple[tuple[tuple[float, float], ...], ...] = ()  # per stage: (time, concurrency)
    panic_since: tuple[float | None, ...] = ()
    panic_peak: tuple[int, ...] = ()


@dataclass(frozen=True)
class KnativeKPA(Reactive):
    """Knative's KPA: concurrency averaged over a 60 s stable and a 6 s panic window; panic when
    the panic-window want reaches 200 % of the ready replicas; in panic it never scales down, and
    it leaves panic after a stable window without the condition. Scale rates bounded. Defaults
    are Knative's: container-concurrency-target-default 100 at target-percentage 70 %."""
    target_concurrency: float = 100.0
    target_utilization: float = 0.7
    stable_window_s: float = 60.0
    panic_window_s: float = 6.0
    panic_threshold: float = 2.0
    max_scale_up_rate: float = 1000.0
    max_scale_down_rate: float = 2.0
    name: str = "knative-kpa"

    def decide(self, state: PipelineState, memory: KPAMemory | None = None, predicted: None = None) -> tuple[Decision, KPAMemory]:
        n = len(state.stages)
        if memory is None or len(memory.samples) != n:
            memory = KPAMemory(((),) * n, (None,) * n, (0,) * n)
        samples, panic_since, peaks, replicas, reasons = [], [], [], [], []
        for i, s in enumerate(state.stages):
            window = tuple((t, c) for t, c in memory.samples[i] if t > state.now - self.stable_window_s)
            window += ((state.now, float(s.concurrency)),)
            r, since, peak, why = self._stage(s, window, state.now, memory.panic_since[i], memory.panic_peak[i])
            r = state.bounds.clamp(r)
            samples.append(window)
            panic_since.append(since)
            peaks.append(peak)
            replicas.append(r)
            reasons.append(why)
        return Decision.of(state, self.name, replicas, reasons), KPAMemory(tuple(samples), tuple(panic_since), tuple(peaks))

    @property
    def target(self) -> float:
        return self.target_concurrency * self.target_utilization

    def _stage(self, s: StageState, window: tuple, now: float, since: float | None,
               peak: int) -> tuple[int, float | None, int, dict]:
        ready = max(1, s.replicas)
        stable = sum(c for _, c in window) / len(window)
        recent = [c for t, c in window if t > now - self.panic_window_s]
        panic = sum(recent) / len(recent)
        up_limit = math.ceil(self.max_scale_up_rate * ready)
        down_limit = math.floor(ready / self.max_scale_down_rate)
        want_stable = _clamp(math.ceil(stable / self.target), down_limit, up_limit)
        want_panic = _clamp(math.ceil(panic / self.target), down_limit, up_limit)
        over = want_panic / ready >= self.panic_threshold
        if over:
            since = now
        elif since is not None and now - since >= self.stable_window_s:
            since, peak = None, 0
        if since is not None:
            peak = max(peak, want_panic, s.replicas)
            desired = peak  # in panic: never scale down
        else:
            desired = want_stable
        why = {"stable_concurrency": round(stable, 3), "panic_concurrency": round(panic, 3),
               "panic": since is not None}
        return desired, since, peak, why


@dataclass(frozen=True)
class RayServe(Reactive):
    """Ray Serve's default policy: replicas = ceil(ongoing requests / target per replica), applied
    only after the want has held for the upscale (30 s) or downscale (600 s) delay."""
    target_ongoing_requests: float = 2.0
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    period_s: float = 1.0
    name: str = "ray-serve"

    def decide(self, state: PipelineState, memory: tuple[int, ...] | None = None, predicted: None = None) -> tuple[Decision, tuple[int, ...]]:
        counters = list(memory) if memory and len(memory) == len(state.stages) else [0] * len(state.stages)
        replicas, reasons = [], []
        for i, s in enumerate(state.stages):
            want = state.bounds.clamp(math.ceil(s.concurrency / self.target_ongoing_requests))
            new = s.replicas
            if want > s.replicas:
                counters[i] = max(counters[i], 0) + 1
                if counters[i] * self.period_s >= self.upscale_delay_s:
                    new, counters[i] = want, 0
            elif want < s.replicas:
                counters[i] = min(counters[i], 0) - 1
                if -counters[i] * self.period_s >= self.downscale_delay_s:
                    new, counters[i] = want, 0
            else:
                counters[i] = 0
            replicas.append(new)
            reasons.append({"ongoing": s.concurrency, "want": want, "counter": counters[i]})
        return Decision.of(state, self.name, replicas, reasons), tuple(counters)


# Each system's rule at its documented defaults, and tuned for stage replicas that take one work
# item at a time and serve a few items per second (named -tuned): OpenFaaS Pro at 5 rps per
# replica, Knative at one item in flight per replica (its single-concurrency containers), Ray
# Serve reacting within seconds instead of its 30 s / 600 s delays.
BASELINES = {p.name: p for p in (
    Static(), INFless(), Cocktail(), InferLine(),
    OpenFaaSPro(), OpenFaaSPro(target_rps=5.0, name="openfaas-pro-rps-tuned"),
    KnativeKPA(), KnativeKPA(target_concurrency=1.0, target_utilization=1.0, name="knative-kpa-tuned"),
    RayServe(), RayServe(upscale_delay_s=3.0, downscale_delay_s=30.0, name="ray-serve-tuned"))}
