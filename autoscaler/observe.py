"""Builds each model's observed state from what the data plane leaves in Redis: per stage
function its records (arrival time at the stage, queue wait, service time, replica), its stream
(items still waiting: stream IDs are arrival times) and its registered replicas. Every stage of
every model is read in two pipelined round trips per tick, and of each stage's records only those
that arrived since the last tick (the window's earlier ones are kept here)."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import redis

from autoscaler.policy.state import PipelineState
from autoscaler.policy.window import Window, stage_state
from contracts.stage import StageRef
from contracts.stage_graph import Edges
from state import keys
from state.records import StageSample
from state.store import RedisStore


@dataclass
class _Records:
    """The records of one stage seen so far in the window."""
    last_id: bytes | None = None
    rows: deque[StageSample] = field(default_factory=deque)

    def add(self, entries: list, since_ms: int) -> None:
        for entry_id, f in entries:
            if entry_id == self.last_id:
                continue  # the range starts at the last id read, inclusive
            self.rows.append(StageSample.decode(entry_id, f))
            self.last_id = entry_id
        while self.rows and self.rows[0].at_ms < since_ms:
            self.rows.popleft()


@dataclass
class Observer:
    """Remembers each stage's last known service time, so that a stage with no traffic in the
    window still has one."""
    r: redis.Redis
    pipelines: dict[str, tuple[StageRef, ...]]
    window_s: float
    graphs: dict[str, Edges] = field(default_factory=dict)  # the models that are not chains
    service_s: dict[StageRef, float] = field(default_factory=dict)
    records: dict[StageRef, _Records] = field(default_factory=dict)

    def observe(self, now: float, desired: dict[str, list[int]], slo_s: float) -> dict[str, PipelineState]:
        """Every model's state; `desired`: the replicas each stage function is asked to have."""
        since_ms = int((now - self.window_s) * 1000)
        refs = [ref for model in self.pipelines for ref in self.pipelines[model]]
        pipe = self.r.pipeline(transaction=False)
        for ref in refs:
            stream = keys.stage_stream(ref.model, ref.first)
            seen = self.records.setdefault(ref, _Records())
            pipe.xrange(keys.records_stream(ref.model, ref.first), min=seen.last_id or f"{since_ms}-0")
            pipe.xrange(stream, min=f"{since_ms}-0")
            pipe.xlen(stream)
            pipe.xpending(stream, keys.GROUP)
            pipe.smembers(keys.stage_replicas(ref.model, ref.first))
        raw = pipe.execute(raise_on_error=False)
        per_ref = {ref: raw[5 * i:5 * i + 5] for i, ref in enumerate(refs)}
        live = RedisStore(self.r).live_of({(ref.model, ref.first): per_ref[ref][4] for ref in refs})
        cpus = {ref: [float(x.cpus) for x in live[(ref.model, ref.first)]] for ref in refs}
        out = {}
        for model, stages in self.pipelines.items():
            states = tuple(self._stage(i, ref, now, since_ms, desired[model][i], per_ref[ref], cpus[ref])
                           for i, ref in enumerate(stages))
            out[model] = PipelineState(model, states, slo_s=slo_s, entry_rate=states[0].arrival_rate, now=now,
                                       edges=self.graphs.get(model))
        return out

    def _stage(self, index: int, ref: StageRef, now: float, since_ms: int, replicas: int, raw: list,
               live_cpus: list[float]):
        new, waiting, length, pending, _ = raw
        # A stream or group that does not exist yet reads as an error here: nothing waits.
        seen = self.records[ref]
        seen.add([] if isinstance(new, Exception) else new, since_ms)
        waiting = [] if isinstance(waiting, Exception) else waiting
        in_flight = 0 if isinstance(pending, Exception) else int(pending["pending"])
        queued = max(0, (0 if isinstance(length, Exception) else length) - in_flight)
        rows = seen.rows
        arrivals = [x.arrived_at for x in rows if x.arrived_at >= now - self.window_s]
        arrivals += [int(i.split(b"-")[0]) / 1000.0 for i, _ in waiting]  # stream IDs are arrival times
        service = np.array([x.service_ms for x in rows]) / 1000.0
        wait = np.array([x.wait_ms for x in rows]) / 1000.0
        if len(service):
            self.service_s[ref] = float(service.mean())
        return stage_state(index, self.window_s, Window.of(np.array(arrivals), service, wait),
                           self.service_s.get(ref, 0.0), replicas, live_cpus, queued, in_flight)
