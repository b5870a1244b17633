"""A stage's observation window, and the StageState built from it: the live Observer and the
cluster simulator both build the state a policy sees with `stage_state`."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autoscaler.policy.state import StageState

# The finest time scale of the traffic envelope (InferLine's tuner): the most arrivals in any
# interval this long within the window.
PEAK_S = 1.0


def peak_count(times: np.ndarray | list[float], span_s: float = PEAK_S) -> int:
    """The most of `times` (sorted) that fall in any interval of `span_s` seconds."""
    t = np.asarray(times, dtype=float)
    if len(t) == 0:
        return 0
    ends = np.searchsorted(t, t + span_s, side="left")
    return int((ends - np.arange(len(t))).max())


def _mean_cv(xs: Sequence[float]) -> tuple[float, float]:
    """The mean and the coefficient of variation (population) of `xs`; (0, 1) when empty, CV 1
    where it is undefined. In Python, not numpy: the Observer calls it for every stage every tick
    on a few dozen values, where numpy's per-call cost is most of the work (8,000 stages)."""
    n = len(xs)
    if not n:
        return 0.0, 1.0
    mean = sum(xs) / n
    if n < 2 or mean <= 0:
        return mean, 1.0
    return mean, math.sqrt(sum((x - mean) ** 2 for x in xs) / n) / mean


@dataclass(frozen=True, slots=True)
class Window:
    """What one stage saw in one observation window: how many items arrived and how bursty,
    and the service and queue-wait times (s) of the items it finished."""
    arrivals: int = 0
    arrival_cv: float = 1.0
    finished: int = 0
    service_mean: float = 0.0
    service_cv: float = 1.0
    wait_mean: float = 0.0
    peak_arrivals: int = 0     # the most arrivals in any PEAK_S seconds of the window

    @classmethod
    def of(cls, arrivals: Sequence[float], service: Sequence[float], wait: Sequence[float]) -> Window:
        arrivals = sorted(arrivals)
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
        service_mean, service_cv = _mean_cv(service)
        return cls(len(arrivals), _mean_cv(gaps)[1] if len(arrivals) > 2 else 1.0, len(service), service_mean,
                   service_cv, _mean_cv(wait)[0], peak_count(arrivals))


def stage_state(stage: int, window_s: float, w: Window, mean_service: float, replicas: int,
                live_cpus: list[float], queued: int, in_flight: int) -> StageState:
    """A stage's observed state from one window and what is waiting and running now. The live
    Observer and the cluster simulator both build states with it."""
    return StageState(
        stage=stage, arrival_rate=w.arrivals / window_s, arrival_cv=w.arrival_cv,
        service_time_s=mean_service, service_cv=w.service_cv,
        replicas=replicas, ready_replicas=len(live_cpus),
        cpus=sum(live_cpus) / len(live_cpus) if live_cpus else 1.0,
        queue_length=queued, in_flight=in_flight, wait_s=w.wait_mean,
        peak_rate=max(w.peak_arrivals / PEAK_S, w.arrivals / window_s),
        busy_fraction=min(1.0, w.finished * w.service_mean / (window_s * max(1, len(live_cpus)))),
        latency_s=w.wait_mean + w.service_mean if w.finished else 0.0)
