"""Timelines sampled from Redis while a replay runs: replicas and queue length per stage; after
it, each stage's arrivals from its records stream give the arrival rate over time and the
observed inter-arrival CV per stage (QUART Fig. 2a), and the samples the mean queue length per
stage (Fig. 2b) and the replica-seconds."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from contracts.loops import start_thread
from state.store import Store

log = logging.getLogger("quart.loadgen")


@dataclass
class Sampler:
    store: Store | None     # None: samples given (the simulator's)
    model: str
    stages: int
    period_s: float = 0.5
    samples: list[tuple[float, list[int], list[int]]] = field(default_factory=list)  # t, replicas, queues
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def sample(self) -> None:
        now = time.time()
        replicas = [len(self.store.live_replicas(self.model, i)) for i in range(self.stages)]
        queues = [self.store.backlog(self.model, i).waiting for i in range(self.stages)]
        self.samples.append((now, replicas, queues))

    def start(self) -> Sampler:
        # A failed sample (the runtime going down at the end of a replay) is logged; the samples
        # so far stand and sampling goes on.
        self._thread = start_thread(self.period_s, self.sample, self._stop, log, "timeline")
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()

    def replica_seconds(self) -> float:
        return float(sum(sum(replicas) for _, replicas, _ in self.samples) * self.period_s)


def stage_arrivals(store: Store, model: str, stages: int, since: float) -> list[np.ndarray]:
    """When work reached each stage (the records' enqueue times), from `since` on."""
    return [np.sort(np.array([x.arrived_at for x in store.samples(model, i, since) if x.arrived_at >= since]))
            for i in range(stages)]


def interarrival_cv(times: np.ndarray) -> float:
    gaps = np.diff(np.sort(times))
    return float(gaps.std() / gaps.mean()) if len(gaps) >= 2 and gaps.mean() > 0 else float("nan")


def timeline(sampler: Sampler, arrivals: list[np.ndarray], start: float, bin_s: float = 1.0) -> dict:
    """Plain lists for the report: per stage, arrival rate per bin, replicas and queue per sample."""
    end = max([start + bin_s] + [t for t, _, _ in sampler.samples] + [a[-1] for a in arrivals if len(a)])
    edges = np.arange(start, end + bin_s, bin_s)
    return {
        "t": [round(t - start, 3) for t, _, _ in sampler.samples],
        "replicas": [list(x) for x in zip(*[s[1] for s in sampler.samples])] if sampler.samples else [],
        "queue": [list(x) for x in zip(*[s[2] for s in sampler.samples])] if sampler.samples else [],
        "rate_t": [round(float(e - start), 3) for e in edges[:-1]],
        "rate": [(np.histogram(a, edges)[0] / bin_s).tolist() for a in arrivals],
        "cv": [interarrival_cv(a) for a in arrivals],
        "mean_queue": [float(np.mean(q)) if len(q) else 0.0
                       for q in zip(*[s[2] for s in sampler.samples])] if sampler.samples else [],
    }
