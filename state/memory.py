"""The state layer's `Store` in one process: what the Redis one keeps, in dictionaries, with
registrations that expire by an injected clock. For unit tests and the simulator, held to the
Redis store's behaviour by tests/live/test_state_store.py."""
from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from contracts.stage import StageRef
from state.records import (
    PIPELINED,
    Activity,
    Backlog,
    CacheEvent,
    ColdStart,
    DecisionRecord,
    LayoutChange,
    Placement,
    ReplicaRecord,
    StageSample,
    StageWindow,
    StartFailure,
    ZygoteRecord,
)
from state.store import Stage


@dataclass
class MemoryStore:
    clock: Callable[[], float] = time.time
    _replicas: dict[str, tuple[ReplicaRecord, float]] = field(default_factory=dict)  # id -> (record, expires at)
    _members: dict[Stage, set[str]] = field(default_factory=dict)
    _samples: dict[Stage, list[tuple[int, StageSample]]] = field(default_factory=dict)  # (sequence, sample)
    _written: int = 0
    _key_stages: dict[str, tuple[StageRef, ...]] = field(default_factory=dict)
    _zygotes: dict[str, dict[str, ZygoteRecord]] = field(default_factory=dict)  # server -> stage key -> zygote
    _backlogs: dict[Stage, Backlog] = field(default_factory=dict)
    _start_failures: dict[str, tuple[dict[int, StartFailure], float]] = field(default_factory=dict)
    _cold_starts: dict[StageRef, ColdStart] = field(default_factory=dict)
    _placements: list[Placement] = field(default_factory=list)
    _decisions: dict[str, list[DecisionRecord]] = field(default_factory=dict)
    _layouts: dict[str, list[LayoutChange]] = field(default_factory=dict)
    _cache_events: dict[str, list[tuple[float, CacheEvent]]] = field(default_factory=dict)
    _stage_cpus: dict[StageRef, float] = field(default_factory=dict)
    _asleep: set[str] = field(default_factory=set)
    _waking_until: dict[str, float] = field(default_factory=dict)
    _activity: dict[str, Activity] = field(default_factory=dict)

    # -- replicas ----------------------------------------------------------------------------

    def register(self, rec: ReplicaRecord, ttl_s: float) -> None:
        now = self.clock()
        self._replicas[rec.replica_id] = (replace(rec, last_seen=now), now + ttl_s)
        for stage in rec.stages():
            self._members.setdefault((rec.model, stage), set()).add(rec.replica_id)

    def heartbeat(self, rec: ReplicaRecord, ttl_s: float) -> None:
        current = self._current(rec.replica_id)
        if current is None:
            self.register(rec, ttl_s)
            return
        now = self.clock()
        self._replicas[rec.replica_id] = (replace(current, last_seen=now), now + ttl_s)

    def update_replica(self, replica_id: str, **progress) -> None:
        ReplicaRecord.progress(progress)  # the same refusal of identity fields as the Redis store's
        current = self._current(replica_id)
        if current is not None:
            self._replicas[replica_id] = (replace(current, **progress), self._replicas[replica_id][1])

    def deregister(self, rec: ReplicaRecord) -> None:
        self._replicas.pop(rec.replica_id, None)
        for stage in rec.stages():
            self._members.get((rec.model, stage), set()).discard(rec.replica_id)

    def replica(self, replica_id: str) -> ReplicaRecord | None:
        return self._current(replica_id)

    def live_replicas(self, model: str, stage: int) -> list[ReplicaRecord]:
        return self.live_among([(model, stage)])[(model, stage)]

    def live_among(self, stages: Iterable[Stage]) -> dict[Stage, list[ReplicaRecord]]:
        out = {}
        for key in stages:
            members = self._members.setdefault(key, set())
            live = {rid: self._current(rid) for rid in sorted(members)}
            members -= {rid for rid, rec in live.items() if rec is None}
            out[key] = [rec for rec in live.values() if rec is not None]
        return out

    def _current(self, replica_id: str) -> ReplicaRecord | None:
        held = self._replicas.get(replica_id)
        if held is None or held[1] <= self.clock():
            self._replicas.pop(replica_id, None)
            return None
        return held[0]

    # -- the stages' records -------------------------------------------------------------------

    def add_sample(self, model: str, stage: int, sample: StageSample, maxlen: int) -> None:
        rows = self._samples.setdefault((model, stage), [])
        self._written += 1
        rows.append((self._written, replace(sample, at_ms=int(self.clock() * 1000))))
        del rows[:-maxlen]

    def samples(self, model: str, stage: int, since_s: float = 0.0) -> list[StageSample]:
        rows = [r for _, r in self._samples.get((model, stage), [])]
        return rows[bisect.bisect_left([r.at_ms for r in rows], int(since_s * 1000)):]

    def latest_samples(self, model: str, stage: int, count: int) -> list[StageSample]:
        return [r for _, r in self._samples.get((model, stage), [])][::-1][:count]

    def stage_windows(self, cursors: dict[Stage, str | None], since_s: float) -> dict[Stage, StageWindow]:
        out = {}
        live = self.live_among(cursors)
        for (model, stage), cursor in cursors.items():
            rows = self._samples.get((model, stage), [])
            new = [(n, r) for n, r in rows if n > int(cursor)] if cursor else \
                [(n, r) for n, r in rows if r.at_ms >= int(since_s * 1000)]
            backlog = self.backlog(model, stage)
            out[(model, stage)] = StageWindow(tuple(r for _, r in new), str(new[-1][0]) if new else cursor,
                                              replace(backlog, arrivals=tuple(t for t in backlog.arrivals if t >= since_s)),
                                              tuple(live[(model, stage)]))
        return out

    # -- key stages, zygotes, queues -------------------------------------------------------------

    def publish_key_stages(self, model: str, stages: tuple[StageRef, ...]) -> None:
        if stages:
            self._key_stages[model] = tuple(stages)
        else:
            self._key_stages.pop(model, None)

    def key_stages(self) -> list[StageRef]:
        return sorted(s for stages in self._key_stages.values() for s in stages)

    def publish_zygote(self, zygote: ZygoteRecord) -> None:
        self._zygotes.setdefault(zygote.server, {})[zygote.stage.key] = zygote

    def withdraw_zygote(self, server: str, stage: StageRef) -> None:
        self._zygotes.get(server, {}).pop(stage.key, None)

    def cached_stages(self, server: str) -> tuple[frozenset[str], int]:
        held = self._zygotes.get(server, {})
        return frozenset(held), sum(z.bytes for z in held.values())

    def set_backlog(self, model: str, stage: int, backlog: Backlog) -> None:
        """A stage's queue as the data plane left it (the Redis store reads the stage's stream)."""
        self._backlogs[(model, stage)] = backlog

    def backlog(self, model: str, stage: int) -> Backlog:
        return self._backlogs.get((model, stage), Backlog())

    # -- starts --------------------------------------------------------------------------------

    def record_start_failure(self, stage: StageRef, reason: str, ttl_s: float) -> None:
        now = self.clock()
        failures = self.start_failures(stage.model)
        failures[stage.first] = StartFailure(reason, now)
        self._start_failures[stage.model] = (failures, now + max(1, int(ttl_s)))

    def start_failures(self, model: str) -> dict[int, StartFailure]:
        failures, expires = self._start_failures.get(model, ({}, 0.0))
        return dict(failures) if expires > self.clock() else {}

    def record_cold_start(self, stage: StageRef, cold: ColdStart) -> None:
        self._cold_starts[StageRef(stage.model, stage.first, stage.first + 1)] = cold

    def cold_start(self, stage: StageRef) -> ColdStart | None:
        return self._cold_starts.get(StageRef(stage.model, stage.first, stage.first + 1))

    # -- what the control plane asks of the stages ----------------------------------------------

    def set_stage_cpus(self, stage: StageRef, cpus: float) -> None:
        self._stage_cpus[stage] = float(cpus)

    def stage_cpus(self, stage: StageRef) -> float | None:
        return self._stage_cpus.get(stage)

    def set_asleep(self, model: str, now: float) -> None:
        self._asleep.add(model)

    def set_awake(self, model: str) -> None:
        self._asleep.discard(model)

    def wake(self, model: str, now: float, waking_ttl_s: float) -> None:
        self._asleep.discard(model)
        self._waking_until[model] = self.clock() + max(1, int(waking_ttl_s))

    def asleep(self, models: list[str]) -> set[str]:
        return self._asleep & set(models)

    def waking(self, model: str) -> bool:
        return self._waking_until.get(model, 0.0) > self.clock()

    def set_activity(self, activity: dict[str, Activity]) -> None:
        self._activity.update(activity)

    def activity(self) -> dict[str, Activity]:
        return dict(self._activity)

    # -- logs of what the control plane did ------------------------------------------------------

    def add_placement(self, placement: Placement, maxlen: int) -> None:
        self.add_placements([placement], maxlen)

    def add_placements(self, placements: list[Placement], maxlen: int) -> None:
        self._placements.extend(placements)
        del self._placements[:-maxlen]

    def placements(self) -> list[Placement]:
        return list(self._placements)

    def add_decision(self, model: str, record: DecisionRecord, maxlen: int) -> None:
        rows = self._decisions.setdefault(model, [])
        rows.append(record)
        del rows[:-maxlen]

    def decisions(self, model: str, count: int | None = None) -> list[DecisionRecord]:
        return self._decisions.get(model, [])[::-1][:count]

    def set_layout(self, model: str, change: LayoutChange, maxlen: int) -> None:
        rows = self._layouts.setdefault(model, [])
        rows.append(change)
        del rows[:-maxlen]

    def layout(self, model: str) -> str:
        rows = self._layouts.get(model)
        return rows[-1].layout if rows else PIPELINED

    def layout_changes(self, model: str) -> list[LayoutChange]:
        return list(self._layouts.get(model, []))

    def add_cache_event(self, server: str, event: CacheEvent, maxlen: int) -> None:
        rows = self._cache_events.setdefault(server, [])
        rows.append((self.clock(), event))
        del rows[:-maxlen]

    def cache_events(self, server: str, since_s: float = 0.0) -> list[CacheEvent]:
        return [e for at, e in self._cache_events.get(server, []) if int(at * 1000) >= int(since_s * 1000)]
