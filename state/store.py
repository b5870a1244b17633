"""Typed reads and writes of the state the components share, over one Redis: replica
registrations, the stages' records, key stages, zygotes, cold starts and start failures.
`MemoryStore` (state/memory.py) does the same in one process for unit tests and the simulator;
tests/live/test_state_store.py holds both to one behaviour."""
from __future__ import annotations

import statistics
import time
from collections.abc import Iterable
from typing import Protocol

import redis

from contracts.stage import StageRef
from scheduler.coldstart import ColdStartCosts
from state import keys
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
    decode_key_stages,
    encode_key_stages,
    stream_ms,
)

# What a store raises when it cannot be reached (a caller that must outlive it catches this).
Unavailable = redis.RedisError

Stage = tuple[str, int]  # (model, stage index): the unit a stage's stream and replica set belong to


class Store(Protocol):
    """What the components read and write of each other. Times are time.time() seconds."""

    def register(self, rec: ReplicaRecord, ttl_s: float) -> None: ...
    def heartbeat(self, rec: ReplicaRecord, ttl_s: float) -> None: ...
    def update_replica(self, replica_id: str, **progress) -> None: ...
    def deregister(self, rec: ReplicaRecord) -> None: ...
    def replica(self, replica_id: str) -> ReplicaRecord | None: ...
    def live_replicas(self, model: str, stage: int) -> list[ReplicaRecord]: ...
    def live_among(self, stages: Iterable[Stage]) -> dict[Stage, list[ReplicaRecord]]: ...
    def add_sample(self, model: str, stage: int, sample: StageSample, maxlen: int) -> None: ...
    def samples(self, model: str, stage: int, since_s: float = 0.0) -> list[StageSample]: ...
    def latest_samples(self, model: str, stage: int, count: int) -> list[StageSample]: ...
    def stage_windows(self, cursors: dict[Stage, str | None], since_s: float) -> dict[Stage, StageWindow]: ...
    def publish_key_stages(self, model: str, stages: tuple[StageRef, ...]) -> None: ...
    def key_stages(self) -> list[StageRef]: ...
    def cached_stages(self, server: str) -> tuple[frozenset[str], int]: ...
    def backlog(self, model: str, stage: int) -> Backlog: ...
    def record_start_failure(self, stage: StageRef, reason: str, ttl_s: float) -> None: ...
    def start_failures(self, model: str) -> dict[int, StartFailure]: ...
    def record_cold_start(self, stage: StageRef, cold: ColdStart) -> None: ...
    def cold_start(self, stage: StageRef) -> ColdStart | None: ...
    def set_stage_cpus(self, stage: StageRef, cpus: float) -> None: ...
    def stage_cpus(self, stage: StageRef) -> float | None: ...
    def set_asleep(self, model: str, now: float) -> None: ...
    def set_activity(self, activity: dict[str, Activity]) -> None: ...
    def activity(self) -> dict[str, Activity]: ...
    def set_awake(self, model: str) -> None: ...
    def wake(self, model: str, now: float, waking_ttl_s: float) -> None: ...
    def asleep(self, models: list[str]) -> set[str]: ...
    def waking(self, model: str) -> bool: ...
    def add_placement(self, placement: Placement, maxlen: int) -> None: ...
    def add_placements(self, placements: list[Placement], maxlen: int) -> None: ...
    def placements(self) -> list[Placement]: ...
    def add_decision(self, model: str, record: DecisionRecord, maxlen: int) -> None: ...
    def decisions(self, model: str, count: int | None = None) -> list[DecisionRecord]: ...
    def set_layout(self, model: str, change: LayoutChange, maxlen: int) -> None: ...
    def layout(self, model: str) -> str: ...
    def layout_changes(self, model: str) -> list[LayoutChange]: ...
    def add_cache_event(self, server: str, event: CacheEvent, maxlen: int) -> None: ...
    def cache_events(self, server: str, since_s: float = 0.0) -> list[CacheEvent]: ...
    def publish_zygote(self, zygote: ZygoteRecord) -> None: ...
    def withdraw_zygote(self, server: str, stage: StageRef) -> None: ...


def _window(cursor: str | None, records: list | Exception, stream: list | Exception, length: int | Exception,
            pending: dict | Exception, live: list[ReplicaRecord]) -> StageWindow:
    # A stream or group that does not exist yet reads as an error here: nothing in it.
    records = [] if isinstance(records, Exception) else records
    samples = tuple(StageSample.decode(i, f) for i, f in records)
    in_flight = 0 if isinstance(pending, Exception) else int(pending["pending"])
    waiting = max(0, (0 if isinstance(length, Exception) else length) - in_flight)
    arrivals = () if isinstance(stream, Exception) else tuple(stream_ms(i) / 1000.0 for i, _ in stream)
    return StageWindow(samples, records[-1][0].decode() if records else cursor, Backlog(waiting, in_flight, arrivals),
                       tuple(live))


class RedisStore:
    def __init__(self, r: redis.Redis) -> None:
        self.r = r

    @classmethod
    def from_url(cls, url: str, timeout_s: float | None = None) -> RedisStore:
        return cls(redis.Redis.from_url(url, socket_timeout=timeout_s))

    # -- replicas ----------------------------------------------------------------------------

    def register(self, rec: ReplicaRecord, ttl_s: float) -> None:
        pipe = self.r.pipeline()
        key = keys.replica(rec.replica_id)
        pipe.hset(key, mapping={**rec.encode(), "last_seen": str(time.time())})
        pipe.pexpire(key, int(ttl_s * 1000))
        for stage in rec.stages():
            pipe.sadd(keys.stage_replicas(rec.model, stage), rec.replica_id)
        pipe.execute()

    def heartbeat(self, rec: ReplicaRecord, ttl_s: float) -> None:
        """Renews the registration; re-creates it if it expired meanwhile (a long pause)."""
        key = keys.replica(rec.replica_id)
        if not self.r.pexpire(key, int(ttl_s * 1000)):
            self.register(rec, ttl_s)
            return
        self.r.hset(key, "last_seen", str(time.time()))

    def update_replica(self, replica_id: str, **progress) -> None:
        """Changes what a running replica reports (PROGRESS fields); nothing if it is not registered."""
        key = keys.replica(replica_id)
        # Only while registered: an update racing the expiry must not leave a record without identity.
        if self.r.exists(key):
            self.r.hset(key, mapping=ReplicaRecord.progress(progress))

    def deregister(self, rec: ReplicaRecord) -> None:
        pipe = self.r.pipeline()
        pipe.delete(keys.replica(rec.replica_id))
        for stage in rec.stages():
            pipe.srem(keys.stage_replicas(rec.model, stage), rec.replica_id)
        pipe.execute()

    def replica(self, replica_id: str) -> ReplicaRecord | None:
        raw = self.r.hgetall(keys.replica(replica_id))
        return ReplicaRecord.decode(raw) if raw else None

    def live_replicas(self, model: str, stage: int) -> list[ReplicaRecord]:
        """Registered replicas of a stage whose heartbeat is current; prunes the expired ones."""
        return self.live_among([(model, stage)])[(model, stage)]

    def live_among(self, stages: Iterable[Stage]) -> dict[Stage, list[ReplicaRecord]]:
        """Each stage's current registrations, read in two pipelined round trips; the expired ids
        are pruned from their sets."""
        stages = list(dict.fromkeys(stages))
        pipe = self.r.pipeline(transaction=False)
        for model, stage in stages:
            pipe.smembers(keys.stage_replicas(model, stage))
        return self.live_of(dict(zip(stages, pipe.execute())))

    def live_of(self, members: dict[Stage, set[bytes]]) -> dict[Stage, list[ReplicaRecord]]:
        """The registrations still current of the replica ids each stage's set held (read by a
        caller that batches the sets with other reads)."""
        ids = {key: sorted(m.decode() for m in ms) for key, ms in members.items()}
        pipe = self.r.pipeline(transaction=False)
        for rids in ids.values():
            for rid in rids:
                pipe.hgetall(keys.replica(rid))
        found = iter(pipe.execute())
        out, prune = {}, self.r.pipeline(transaction=False)
        for (model, stage), rids in ids.items():
            got = [(rid, next(found)) for rid in rids]
            out[(model, stage)] = [ReplicaRecord.decode(data) for _, data in got if data]
            dead = [rid for rid, data in got if not data]
            if dead:
                prune.srem(keys.stage_replicas(model, stage), *dead)
        prune.execute()
        return out

    # -- the stages' records -------------------------------------------------------------------

    def add_sample(self, model: str, stage: int, sample: StageSample, maxlen: int) -> None:
        self.r.xadd(keys.records_stream(model, stage), sample.encode(), maxlen=maxlen, approximate=True)

    def samples(self, model: str, stage: int, since_s: float = 0.0) -> list[StageSample]:
        """A stage's records written since `since_s`, oldest first."""
        entries = self.r.xrange(keys.records_stream(model, stage), min=f"{int(since_s * 1000)}-0")
        return [StageSample.decode(i, f) for i, f in entries]

    def latest_samples(self, model: str, stage: int, count: int) -> list[StageSample]:
        """A stage's `count` latest records, newest first."""
        return [StageSample.decode(i, f) for i, f in self.r.xrevrange(keys.records_stream(model, stage), count=count)]

    def stage_windows(self, cursors: dict[Stage, str | None], since_s: float) -> dict[Stage, StageWindow]:
        """Per stage, in two pipelined round trips for all of them: its records after `cursor`
        (None: those written since `since_s`), its queue with the arrival times (stream IDs are
        arrival times) of its stream's items since `since_s`, and its live replicas."""
        since = f"{int(since_s * 1000)}-0"
        pipe = self.r.pipeline(transaction=False)
        for (model, stage), cursor in cursors.items():
            stream = keys.stage_stream(model, stage)
            pipe.xrange(keys.records_stream(model, stage), min=f"({cursor}" if cursor else since)
            pipe.xrange(stream, min=since)
            pipe.xlen(stream)
            pipe.xpending(stream, keys.GROUP)
            pipe.smembers(keys.stage_replicas(model, stage))
        raw = pipe.execute(raise_on_error=False)
        per = {stage: raw[5 * i:5 * i + 5] for i, stage in enumerate(cursors)}
        live = self.live_of({stage: got[4] for stage, got in per.items()})
        return {stage: _window(cursors[stage], *got[:4], live[stage]) for stage, got in per.items()}

    # -- key stages ----------------------------------------------------------------------------

    def publish_key_stages(self, model: str, stages: tuple[StageRef, ...]) -> None:
        """The autoscaler's current key stages of a model, replacing the model's earlier ones."""
        if stages:
            self.r.hset(keys.key_stages(), model, encode_key_stages(stages))
        else:
            self.r.hdel(keys.key_stages(), model)

    def key_stages(self) -> list[StageRef]:
        """Every key stage of every model, from the one index (no scan)."""
        return sorted(s for model, raw in self.r.hgetall(keys.key_stages()).items()
                      for s in decode_key_stages(model.decode(), raw))

    # -- zygotes -------------------------------------------------------------------------------

    def publish_zygote(self, zygote: ZygoteRecord) -> None:
        pipe = self.r.pipeline()
        pipe.hset(keys.zygote(zygote.server, zygote.stage), mapping=zygote.encode())
        pipe.sadd(keys.zygotes(zygote.server), zygote.stage.key)
        pipe.execute()

    def withdraw_zygote(self, server: str, stage: StageRef) -> None:
        """Out of the set the scheduler reads first, so that no fork is sent to it while it ends."""
        self.r.srem(keys.zygotes(server), stage.key)
        self.r.delete(keys.zygote(server, stage))

    def cached_stages(self, server: str) -> tuple[frozenset[str], int]:
        """The "model:stages" a server's KeysManager holds, and their bytes."""
        members = sorted(m.decode() for m in self.r.smembers(keys.zygotes(server)))
        pipe = self.r.pipeline()
        for member in members:
            pipe.hget(keys.zygote(server, StageRef.from_key(member)), "bytes")
        sizes = pipe.execute()
        return frozenset(members), sum(int(b) for b in sizes if b is not None)

    # -- queues --------------------------------------------------------------------------------

    def backlog(self, model: str, stage: int) -> Backlog:
        """A stage's queue: items no replica has taken yet, and those taken and not acknowledged."""
        stream = keys.stage_stream(model, stage)
        try:
            in_flight = int(self.r.xpending(stream, keys.GROUP)["pending"])
        except redis.ResponseError:  # no group yet: nothing has been delivered
            in_flight = 0
        return Backlog(max(0, self.r.xlen(stream) - in_flight), in_flight)

    # -- starts --------------------------------------------------------------------------------

    def record_start_failure(self, stage: StageRef, reason: str, ttl_s: float) -> None:
        """A replica of `stage` could not start: the reason, for the requests that wait on it."""
        key = keys.start_failures(stage.model)
        pipe = self.r.pipeline()
        pipe.hset(key, str(stage.first), StartFailure(reason, time.time()).encode())
        pipe.expire(key, max(1, int(ttl_s)))
        pipe.execute()

    def start_failures(self, model: str) -> dict[int, StartFailure]:
        return {int(k): StartFailure.decode(v) for k, v in self.r.hgetall(keys.start_failures(model)).items()}

    def record_cold_start(self, stage: StageRef, cold: ColdStart) -> None:
        """A replica of `stage` loaded its shards itself: when each step of its start ended."""
        self.r.hset(keys.coldstarts(stage.model), str(stage.first), cold.encode())

    def cold_start(self, stage: StageRef) -> ColdStart | None:
        raw = self.r.hget(keys.coldstarts(stage.model), str(stage.first))
        return ColdStart.decode(raw) if raw else None


    # -- what the control plane asks of the stages ----------------------------------------------

    def set_stage_cpus(self, stage: StageRef, cpus: float) -> None:
        """The CPUs each replica of a stage function should use (replicas apply it between items)."""
        self.r.set(keys.stage_cpus(stage), f"{cpus:g}")

    def stage_cpus(self, stage: StageRef) -> float | None:
        raw = self.r.get(keys.stage_cpus(stage))
        try:
            return float(raw) if raw is not None else None
        except ValueError:
            return None

    def set_asleep(self, model: str, now: float) -> None:
        """The gateway holds the model's stage functions at zero for idleness: the autoscaler
        leaves it alone until a request wakes it."""
        self.r.set(keys.asleep(model), f"{now:.3f}")

    def set_awake(self, model: str) -> None:
        self.r.delete(keys.asleep(model))

    def wake(self, model: str, now: float, waking_ttl_s: float) -> None:
        """Awake, and starting from zero for `waking_ttl_s`: its entry admits requests to queue
        behind the first instead of refusing them for the queue they find."""
        pipe = self.r.pipeline()
        pipe.delete(keys.asleep(model))
        pipe.set(keys.waking(model), f"{now:.3f}", ex=max(1, int(waking_ttl_s)))
        pipe.execute()

    def asleep(self, models: list[str]) -> set[str]:
        pipe = self.r.pipeline(transaction=False)
        for model in models:
            pipe.exists(keys.asleep(model))
        return {m for m, found in zip(models, pipe.execute()) if found}

    def waking(self, model: str) -> bool:
        return bool(self.r.exists(keys.waking(model)))

    def holdings(self) -> dict:
        """What Redis holds (a soak's view, Redis only): used memory (INFO memory), keys (DBSIZE)
        and every stream's length."""
        streams = {key.decode(): self.r.xlen(key) for key in self.r.scan_iter(_type="STREAM", count=1000)}
        return {"used_memory": int(self.r.info("memory")["used_memory"]), "keys": self.r.dbsize(), "streams": streams}

    def set_activity(self, activity: dict[str, Activity]) -> None:
        """Every model's activity at the gateway, in one write."""
        if activity:
            self.r.hset(keys.activity(), mapping={m: a.encode() for m, a in activity.items()})

    def activity(self) -> dict[str, Activity]:
        return {m.decode(): Activity.decode(raw) for m, raw in self.r.hgetall(keys.activity()).items()}

    # -- logs of what the control plane did ------------------------------------------------------

    def add_placement(self, placement: Placement, maxlen: int) -> None:
        self.add_placements([placement], maxlen)

    def add_placements(self, placements: list[Placement], maxlen: int) -> None:
        """A placement round's records, in one round trip."""
        pipe = self.r.pipeline(transaction=False)
        for placement in placements:
            pipe.xadd(keys.placements(), placement.encode(), maxlen=maxlen, approximate=True)
        pipe.execute()

    def placements(self) -> list[Placement]:
        return [Placement.decode(f) for _, f in self.r.xrange(keys.placements())]

    def add_decision(self, model: str, record: DecisionRecord, maxlen: int) -> None:
        self.r.xadd(keys.decisions(model), record.encode(), maxlen=maxlen, approximate=True)

    def decisions(self, model: str, count: int | None = None) -> list[DecisionRecord]:
        """A model's decisions, newest first (the `count` latest)."""
        return [DecisionRecord.decode(f) for _, f in self.r.xrevrange(keys.decisions(model), count=count)]

    def set_layout(self, model: str, change: LayoutChange, maxlen: int) -> None:
        pipe = self.r.pipeline()
        pipe.set(keys.layout(model), change.layout)
        pipe.xadd(keys.layout_decisions(model), change.encode(), maxlen=maxlen, approximate=True)
        pipe.execute()

    def layout(self, model: str) -> str:
        raw = self.r.get(keys.layout(model))
        return raw.decode() if raw else PIPELINED

    def layout_changes(self, model: str) -> list[LayoutChange]:
        return [LayoutChange.decode(f) for _, f in self.r.xrange(keys.layout_decisions(model))]

    def add_cache_event(self, server: str, event: CacheEvent, maxlen: int) -> None:
        self.r.xadd(keys.cache_events(server), event.encode(), maxlen=maxlen, approximate=True)

    def cache_events(self, server: str, since_s: float = 0.0) -> list[CacheEvent]:
        return [CacheEvent.decode(f) for _, f in self.r.xrange(keys.cache_events(server), min=f"{int(since_s * 1000)}-0")]


def after_fetch_s(store: Store, stage: StageRef, stages: list[StageRef], samples: int = 50) -> float:
    """What follows a cold start's fetch before the first token, as measured: this stage's latest
    load after its bytes were in, plus the model's prefill pass; 0 for what was never measured."""
    cold = store.cold_start(stage)
    return (cold.load_after_fetch_s if cold else 0.0) + pass_s(store, stages, "prefill", samples)


def pass_s(store: Store, stages: list[StageRef], kind: str, samples: int = 50) -> float:
    """A pass of `kind` (prefill, decode) through `stages`, as measured: each stage's median
    service time of that kind over its latest `samples` records, summed; 0 for a stage never measured."""
    total = 0.0
    for s in stages:
        times = sorted(x.service_ms for x in store.latest_samples(s.model, s.first, samples) if x.kind == kind)
        total += times[len(times) // 2] / 1000.0 if times else 0.0
    return total


def cold_start_costs(store: Store, stages: list[StageRef]) -> tuple[ColdStartCosts, float]:
    """HydraServe's costs from the stages' latest cold starts and records, and the rate (bytes/s)
    fetched bytes became weights at after the fetch (infinite where loading kept up with it).
    Unmeasured, and taken as 0: process creation before the interpreter runs (either layout pays
    it) and the hops between stages (milliseconds, where the choice turns on seconds of fetch)."""
    colds = [c for s in stages if (c := store.cold_start(s)) is not None]
    imports = [c.imported_at - c.process_at for c in colds if c.imported_at and c.process_at]
    loading = sum(c.load_after_fetch_s for c in colds if c.bytes)
    load_rate = sum(c.bytes for c in colds) / loading if loading > 0 else float("inf")
    costs = ColdStartCosts(create_s=0.0, libraries_s=statistics.median(imports) if imports else 0.0,
                           prefill_s=pass_s(store, stages, "prefill"), decode_s=pass_s(store, stages, "decode"), hop_s=0.0)
    return costs, load_rate
