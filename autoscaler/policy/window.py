"""A stage's observation window, and the StageState built from it: the live Observer and the
cluster simulator both build the state a policy sees with `stage_state`."""
from __future__ import annotations

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


def _cv(times: np.ndarray) -> float:
    gaps = np.diff(np.sort(times))
    return float(gaps.std() / gaps.mean()) if len(gaps) >= 2 and gaps.mean() > 0 else 1.0


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
    def of(cls, arrivals: np.ndarray, service: np.ndarray, wait: np.ndarray) -> Window:
        arrivals = np.sort(arrivals)
        return cls(len(arrivals), _cv(arrivals) if len(arrivals) > 2 else 1.0, len(service),
                   float(service.mean()) if len(service) else 0.0,
                   float(service.std() / service.mean()) if len(service) > 1 and service.mean() > 0 else 1.0,
                   float(wait.mean()) if len(wait) else 0.0, peak_count(arrivals))


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
