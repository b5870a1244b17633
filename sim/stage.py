"""One pipeline stage in the simulator: its shared queue, its replicas, its service-time draws
and the window of what it observed, which becomes the StageState a policy sees."""
from __future__ import annotations

import math
from collections import deque

import numpy as np

from autoscaler.policy.state import StageState
from autoscaler.policy.window import Window, peak_count, stage_state
from contracts.stage import StageRef
from scheduler.state import ReplicaId
from sim.step_cost import StepCost

DRAWS = 4096


class SimReplica:
    """A simulated stage replica. `busy`: computing an item (a batch, for a generative stage). A
    generative stage's replica also has its own queue of decode steps, the sequences whose KV
    cache it holds (request -> bytes), prefills waiting for KV room (item, taken at), and how many
    batches ran without a new request (sim.generation)."""
    __slots__ = ("id", "stage", "server", "started_by", "started_at", "ready", "draining", "busy",
                 "private", "held", "kv_used", "waiting", "steps_without_new")

    def __init__(self, rid: ReplicaId, stage: Stage, server: object, started_by: str, started_at: float) -> None:
        self.id, self.stage, self.server = rid, stage, server
        self.started_by, self.started_at = started_by, started_at
        self.ready = self.draining = self.busy = False
        self.private: deque = deque()
        self.held: dict[int, int] = {}
        self.kv_used = 0
        self.waiting: list[tuple[tuple, float]] = []
        self.steps_without_new = 0


class Stage:
    """Service times are Gamma with the profile's mean and CV, scaled by Amdahl's law for the
    stage's CPUs, drawn in blocks from the stage's own generator (deterministic for a seed)."""

    def __init__(self, ref: StageRef, mean_s: float, cv: float, parallel_fraction: float,
                 overhead_s: float, shard_bytes: int, rng: np.random.Generator) -> None:
        """`ref`: the stage function it simulates (one stage of a pipeline, or a whole model)."""
        self.ref, self.model, self.index, self.key = ref, ref.model, ref.first, ref.key
        self.mean_s, self.shape, self.parallel = mean_s, 1.0 / (cv * cv), parallel_fraction
        self.overhead_s, self.shard_bytes, self.rng = overhead_s, shard_bytes, rng
        self.cpus = 1
        self.desired = 0
        self.cost: StepCost | None = None     # a generative stage's batched step (sim.generation)
        self.next: Stage | None = None      # a chain's next stage (generative models)
        self.successors: list[Stage] = []    # every stage this one's output goes to
        self.predecessors = 0                # parts a request brings before it starts here
        self.queue: deque = deque()          # (request, handed-off time)
        self.idle: list[SimReplica] = []
        self.replicas: list[SimReplica] = []    # every replica holding a slot, draining ones too
        # The observation window, with running sums so a tick costs O(1) per item that left it.
        self.arrivals: deque = deque()        # arrival times
        self.gaps = [0.0, 0.0]                # sum and sum of squares of inter-arrival gaps
        self.done: deque = deque()            # (finished, service, wait)
        self.sums = [0.0, 0.0, 0.0]           # service, service squared, wait
        self.last_service = 0.0
        self.busy = 0
        self._draws = np.empty(0)
        self._pos = 0

    def service_s(self, slowdown: float = 1.0) -> float:
        if self._pos == len(self._draws):
            self._draws = self.rng.standard_gamma(self.shape, DRAWS) / self.shape
            self._pos = 0
        x = self._draws[self._pos]
        self._pos += 1
        return float(x) * self.mean_s * ((1 - self.parallel) + self.parallel / self.cpus) + self.overhead_s * slowdown

    def serving(self) -> list[SimReplica]:
        return [r for r in self.replicas if not r.draining]

    def ready_count(self) -> int:
        return sum(1 for r in self.replicas if r.ready)

    def arrive(self, t: float) -> None:
        if self.arrivals:
            g = t - self.arrivals[-1]
            self.gaps[0] += g
            self.gaps[1] += g * g
        self.arrivals.append(t)

    def finish(self, t: float, service: float, wait: float) -> None:
        self.done.append((t, service, wait))
        self.sums[0] += service
        self.sums[1] += service * service
        self.sums[2] += wait

    def window(self, now: float, window_s: float) -> Window:
        """The last `window_s` seconds, as the live Observer reads them from Redis."""
        since, arrivals, done = now - window_s, self.arrivals, self.done
        while arrivals and arrivals[0] < since:
            t = arrivals.popleft()
            if arrivals:
                g = arrivals[0] - t
                self.gaps[0] -= g
                self.gaps[1] -= g * g
        if len(arrivals) < 2:
            self.gaps = [0.0, 0.0]
        while done and done[0][0] < since:
            _, service, wait = done.popleft()
            self.sums[0] -= service
            self.sums[1] -= service * service
            self.sums[2] -= wait
        if not done:
            self.sums = [0.0, 0.0, 0.0]
        n, k = len(arrivals), len(done)
        cv = 1.0
        if n > 2 and self.gaps[0] > 0:
            mean = self.gaps[0] / (n - 1)
            cv = math.sqrt(max(0.0, self.gaps[1] / (n - 1) - mean * mean)) / mean
        s_mean = self.sums[0] / k if k else 0.0
        s_cv = math.sqrt(max(0.0, self.sums[1] / k - s_mean * s_mean)) / s_mean if k > 1 and s_mean > 0 else 1.0
        return Window(n, cv, k, s_mean, s_cv, self.sums[2] / k if k else 0.0, peak_count(arrivals))

    def observe(self, now: float, window_s: float) -> StageState:
        w = self.window(now, window_s)
        if w.finished:
            self.last_service = w.service_mean
        live = [float(self.cpus)] * sum(1 for r in self.replicas if r.ready and not r.draining)
        return stage_state(self.index, window_s, w, self.last_service, self.desired, live, len(self.queue), self.busy)
