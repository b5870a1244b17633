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


# Every stage's window in one call per chunk of stages, where six commands a stage through
# redis-py cost the autoscaler's tick most of its time at thousands of stages. KEYS: per stage its
# records stream, its work stream, its replica set. ARGV[1]: the consumer group; ARGV[2]: the
# window's first stream id; ARGV[3]: the replica hashes' key prefix; ARGV[3 + i]: stage i's first
# record id. Per stage: its new records, its work items' ids (their arrival times; not their
# payloads), the stream's length, the items held by a replica, and the live replicas' hashes;
# expired ids leave the set. It reads the hashes its sets name, keys not in KEYS: a standalone
# Redis (this project's) allows that; a Redis Cluster would not.
_STAGE_WINDOWS = """
local out = {}
for i = 1, #KEYS / 3 do
  local records, work, members = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  local arrivals = {}
  for _, entry in ipairs(redis.call('XRANGE', work, ARGV[2], '+')) do arrivals[#arrivals + 1] = entry[1] end
  local pending = redis.pcall('XPENDING', work, ARGV[1])
  if type(pending) ~= 'table' or pending.err then pending = {0} end
  local live, dead = {}, {}
  for _, id in ipairs(redis.call('SMEMBERS', members)) do
    local h = redis.call('HGETALL', ARGV[3] .. id)
    if #h > 0 then live[#live + 1] = h else dead[#dead + 1] = id end
  end
  if #dead > 0 then redis.call('SREM', members, unpack(dead)) end
  out[i] = {redis.call('XRANGE', records, ARGV[3 + i], '+'), arrivals, redis.call('XLEN', work), pending[1], live}
end
return out
"""
# Stages a call reads: a call blocks Redis while it runs (about 3 ms for 64 on the 2-core VM).
_WINDOWS_PER_CALL = 64


def _window(cursor: str | None, records: list, arrivals: list, length: int, in_flight: int,
            live: list[list[bytes]]) -> StageWindow:
    """One stage's part of _STAGE_WINDOWS' answer."""
    samples = tuple(StageSample.decode(i, _pairs(f)) for i, f in records)
    replicas = sorted((ReplicaRecord.decode(_pairs(h)) for h in live), key=lambda r: r.replica_id)
    backlog = Backlog(max(0, length - in_flight), in_flight, tuple(stream_ms(i) / 1000.0 for i in arrivals))
    return StageWindow(samples, records[-1][0].decode() if records else cursor, backlog, tuple(replicas))


def _pairs(flat: list) -> dict:
    """A Lua script's flat [field, value, ...] as the dict redis-py makes of a hash or an entry."""
    return dict(zip(flat[::2], flat[1::2]))


class RedisStore:
    def __init__(self, r: redis.Redis) -> None:
        self.r = r
        self._windows = r.register_script(_STAGE_WINDOWS)

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
        ids = {key: sorted(m.decode() for m in ms) for key, ms in zip(stages, pipe.execute())}
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
        """Per stage, in one round trip for all of them: its records after `cursor` (None: those
        written since `since_s`), its queue with the arrival times (stream IDs are arrival times)
        of its stream's items since `since_s`, and its live replicas."""
        since = f"{int(since_s * 1000)}-0"
        stages = list(cursors)
        pipe = self.r.pipeline(transaction=False)
        for start in range(0, len(stages), _WINDOWS_PER_CALL):
            chunk = stages[start:start + _WINDOWS_PER_CALL]
            self._windows(keys=[k for model, stage in chunk for k in (
                              keys.records_stream(model, stage), keys.stage_stream(model, stage),
                              keys.stage_replicas(model, stage))],
                          args=[keys.GROUP, since, keys.replica(""),
                                *(f"({cursors[s]}" if cursors[s] else since for s in chunk)], client=pipe)
        answers = (answer for chunk in pipe.execute() for answer in chunk)
        return {stage: _window(cursors[stage], *answer) for stage, answer in zip(stages, answers)}

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
