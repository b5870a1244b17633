"""Builds a policy's observed state from what the data plane leaves in Redis: each stage's records
(arrival time at the stage, queue wait, service time, replica), its stream (items still waiting:
stream IDs are arrival times), and the replica registry."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import redis

from autoscaler.policy.state import PipelineState, StageState
from contracts import keys
from pipeline.registry import live_replicas, stream_backlog


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

    @classmethod
    def of(cls, arrivals: np.ndarray, service: np.ndarray, wait: np.ndarray) -> Window:
        return cls(len(arrivals), _cv(arrivals) if len(arrivals) > 2 else 1.0, len(service),
                   float(service.mean()) if len(service) else 0.0,
                   float(service.std() / service.mean()) if len(service) > 1 and service.mean() > 0 else 1.0,
                   float(wait.mean()) if len(wait) else 0.0)


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
        latency_s=w.wait_mean + w.service_mean if w.finished else 0.0)


@dataclass
class Observer:
    """Reads one model's stages. Remembers each stage's last known service time, so that a stage
    with no traffic in the window still has one."""
    r: redis.Redis
    model: str
    num_stages: int
    window_s: float
    service_s: dict[int, float] = field(default_factory=dict)

    def stage(self, stage: int, now: float, replicas: int) -> StageState:
        since_ms = int((now - self.window_s) * 1000)
        done = self.r.xrange(keys.records_stream(self.model, stage), min=f"{since_ms}-0")
        stream = keys.stage_stream(self.model, stage)
        waiting = self.r.xrange(stream, min=f"{since_ms}-0")
        queued, in_flight = stream_backlog(self.r, self.model, stage)
        arrivals = [float(f[b"t"]) for _, f in done if float(f[b"t"]) >= now - self.window_s]
        arrivals += [int(i.split(b"-")[0]) / 1000.0 for i, _ in waiting]
        service = np.array([float(f[b"s"]) for _, f in done]) / 1000.0
        wait = np.array([float(f[b"q"]) for _, f in done]) / 1000.0
        if len(service):
            self.service_s[stage] = float(service.mean())
        mean_service = self.service_s.get(stage, 0.0)
        cpus = [float(x.get("cpus", 1)) for x in live_replicas(self.r, self.model, stage)]
        return stage_state(stage, self.window_s, Window.of(np.array(arrivals), service, wait), mean_service,
                           replicas, cpus, queued, in_flight)

    def observe(self, now: float, replicas: list[int], slo_s: float) -> PipelineState:
        stages = tuple(self.stage(i, now, replicas[i]) for i in range(self.num_stages))
        return PipelineState(self.model, stages, slo_s=slo_s, entry_rate=stages[0].arrival_rate, now=now)
