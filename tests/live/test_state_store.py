"""One behaviour for both stores: every test here runs against the Redis store (a real
redis-server) and the in-memory one, so that unit tests and the simulator on the memory store see
what the components see on Redis."""
from __future__ import annotations

import dataclasses
import time

import pytest
import redis

from contracts.stage import StageRef
from state import keys
from state.memory import MemoryStore
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
from state.store import RedisStore, after_fetch_s


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def redis_client(module_redis_port):
    return redis.Redis(port=module_redis_port)


@pytest.fixture(params=["redis", "memory"])
def store(request, redis_client):
    """(the store, a function that lets `seconds` pass for it)."""
    if request.param == "redis":
        redis_client.flushdb()
        return RedisStore(redis_client), time.sleep
    clock = Clock()

    def advance(seconds: float) -> None:
        clock.now += seconds
    return MemoryStore(clock=clock), advance


def replica(rid: str = "m-s1.here.7", first: int = 1, last: int = 2, **more) -> ReplicaRecord:
    return ReplicaRecord(rid, "m", first, last, "here", 7, started_by="fork-cow", started_at=123.5, **more)


def same(a: ReplicaRecord, b: ReplicaRecord) -> bool:
    return dataclasses.replace(a, last_seen=0.0) == dataclasses.replace(b, last_seen=0.0)


def test_a_registered_replica_reads_back_as_written_in_every_stage_it_serves(store):
    s, _ = store
    rec = replica("m-s0-2.here.7", 0, 2, cpus=3)
    s.register(rec, ttl_s=30)
    assert [same(x, rec) for x in s.live_replicas("m", 0)] == [True]
    assert [same(x, rec) for x in s.live_replicas("m", 1)] == [True]
    assert s.live_replicas("m", 2) == []
    assert same(s.replica(rec.replica_id), rec) and s.replica("nobody") is None
    assert s.replica(rec.replica_id).last_seen > 0


def test_progress_changes_what_a_replica_reports_and_nothing_else(store):
    s, _ = store
    rec = replica()
    s.register(rec, ttl_s=30)
    cold = ColdStart(process_at=1.0, loaded_at=2.5, bytes=10)
    s.update_replica(rec.replica_id, draining=True, sequences=4, kv_bytes=4096, cpus=2, coldstart=cold, first_work_at=9.25)
    got = s.replica(rec.replica_id)
    assert (got.draining, got.sequences, got.kv_bytes, got.cpus, got.coldstart, got.first_work_at) == \
        (True, 4, 4096, 2, cold, 9.25)
    assert same(dataclasses.replace(got, draining=False, sequences=0, kv_bytes=0, cpus=1, coldstart=None,
                                    first_work_at=None), rec)
    with pytest.raises(ValueError, match="server"):
        s.update_replica(rec.replica_id, server="elsewhere")
    s.update_replica("gone", sequences=1)       # a replica that left is not brought back half-made
    assert s.replica("gone") is None


def test_a_replica_whose_heartbeat_stops_expires_and_is_pruned(store):
    s, advance = store
    kept, lapsed = replica("m-s1.here.1"), replica("m-s1.here.2")
    s.register(kept, ttl_s=5)
    s.register(lapsed, ttl_s=0.4)
    advance(0.6)
    s.heartbeat(kept, ttl_s=5)
    assert [x.replica_id for x in s.live_replicas("m", 1)] == [kept.replica_id]
    # A heartbeat after expiry registers it again (a replica paused longer than its TTL).
    s.heartbeat(lapsed, ttl_s=5)
    assert sorted(x.replica_id for x in s.live_replicas("m", 1)) == [kept.replica_id, lapsed.replica_id]


def test_deregistered_replicas_are_gone_from_every_stage(store):
    s, _ = store
    rec = replica("m-s0-2.here.7", 0, 2)
    s.register(rec, ttl_s=30)
    s.deregister(rec)
    assert s.live_among([("m", 0), ("m", 1)]) == {("m", 0): [], ("m", 1): []}


def test_samples_come_back_in_order_from_a_time_on(store):
    s, advance = store
    written = []
    for k in range(5):
        sample = StageSample(f"r{k}.0.0", 100.0 + k, 1.5, 20.0 + k, "m-s1.here.7", "prefill" if k % 2 else "decode", k + 1)
        s.add_sample("m", 1, sample, maxlen=1000)
        written.append(sample)
        advance(0.01)
    got = s.samples("m", 1)
    assert [dataclasses.replace(x, at_ms=0) for x in got] == written
    assert got == sorted(got, key=lambda x: x.at_ms) and got[0].at_ms > 0
    assert s.samples("m", 1, since_s=got[-1].at_ms / 1000.0 + 1) == []
    assert [x.request_id for x in s.latest_samples("m", 1, 2)] == ["r4.0.0", "r3.0.0"]
    assert s.samples("m", 0) == []


def test_key_stages_are_one_index_that_each_model_replaces(store):
    s, _ = store
    s.publish_key_stages("b", (StageRef("b", 2, 3),))
    s.publish_key_stages("a", (StageRef("a", 1, 3), StageRef("a", 0, 1)))
    assert s.key_stages() == [StageRef("a", 0, 1), StageRef("a", 1, 3), StageRef("b", 2, 3)]
    s.publish_key_stages("a", (StageRef("a", 3, 4),))
    s.publish_key_stages("b", ())
    assert s.key_stages() == [StageRef("a", 3, 4)]


def test_start_failures_are_kept_for_their_time(store):
    s, advance = store
    s.record_start_failure(StageRef("m", 2, 3), "checksum mismatch", ttl_s=1)
    got = s.start_failures("m")
    assert list(got) == [2] and got[2].reason == "checksum mismatch" and isinstance(got[2], StartFailure)
    advance(1.3)
    assert s.start_failures("m") == {}


def test_the_time_after_a_fetch_is_the_load_plus_the_median_prefill_of_each_stage(store):
    s, _ = store
    stages = [StageRef("m", 0, 1), StageRef("m", 1, 2)]
    assert after_fetch_s(s, stages[1], stages) == 0.0            # nothing measured yet
    s.record_cold_start(stages[1], ColdStart(fetched_at=100.0, loaded_at=101.5))
    assert s.cold_start(stages[1]) == ColdStart(fetched_at=100.0, loaded_at=101.5) and s.cold_start(stages[0]) is None
    for stage, service_ms in ((0, (200, 300, 400)), (1, (100, 700, 900))):
        for ms in service_ms:
            s.add_sample("m", stage, StageSample("x.0.0", 0.0, 0.0, ms, "r", "prefill"), maxlen=100)
        s.add_sample("m", stage, StageSample("x.0.1", 0.0, 0.0, 9000, "r", "decode"), maxlen=100)
    assert after_fetch_s(s, stages[1], stages) == pytest.approx(1.5 + 0.3 + 0.7)


def test_the_redis_store_counts_a_stages_waiting_and_taken_work(redis_client):
    """(The memory store's backlog is set by its caller: it has no streams.)"""
    redis_client.flushdb()
    s = RedisStore(redis_client)
    stream = keys.stage_stream("m", 0)
    assert (s.backlog("m", 0).waiting, s.backlog("m", 0).in_flight) == (0, 0)   # no stream, no group yet
    redis_client.xgroup_create(stream, keys.GROUP, id="0", mkstream=True)
    for k in range(3):
        redis_client.xadd(stream, {"k": str(k)})
    redis_client.xreadgroup(keys.GROUP, "c", {stream: ">"}, count=1)
    assert (s.backlog("m", 0).waiting, s.backlog("m", 0).in_flight) == (2, 1)


def test_the_redis_stores_stage_windows_read_queues_and_prune_expired_replicas(redis_client):
    """The one script that reads every stage at once: waiting and taken items with their
    arrival times, live replicas in id order, expired ids gone from the set, a stage with no
    stream or group read as empty (and more stages than one script call reads)."""
    redis_client.flushdb()
    s = RedisStore(redis_client)
    stream = keys.stage_stream("m", 0)
    redis_client.xgroup_create(stream, keys.GROUP, id="0", mkstream=True)
    ids = [redis_client.xadd(stream, {"k": str(k)}, id=f"{1000 * (k + 1)}-0") for k in range(3)]
    redis_client.xreadgroup(keys.GROUP, "c", {stream: ">"}, count=1)
    for rid in ("m-s0.b.2", "m-s0.a.1", "m-s0.gone.3"):
        s.register(replica(rid, first=0, last=1), ttl_s=60)
    redis_client.delete(keys.replica("m-s0.gone.3"))        # its registration expired
    cursors = {("m", 0): None, **{("other", k): None for k in range(300)}}
    windows = s.stage_windows(cursors, since_s=0.0)
    w = windows[("m", 0)]
    assert (w.backlog.waiting, w.backlog.in_flight, w.backlog.arrivals) == (2, 1, (1.0, 2.0, 3.0)) and len(ids) == 3
    assert [r.replica_id for r in w.replicas] == ["m-s0.a.1", "m-s0.b.2"]
    assert redis_client.smembers(keys.stage_replicas("m", 0)) == {b"m-s0.a.1", b"m-s0.b.2"}
    assert len(windows) == 301 and windows[("other", 299)] == StageWindow((), None, Backlog(0, 0, ()), ())


def test_stage_windows_read_on_from_their_cursor(store):
    """The autoscaler's read of every stage at once: records since the window's start at first,
    then only those written after the cursor; the queue; the live replicas."""
    s, advance = store
    s.register(replica("m-s0.here.1", first=0, last=1), ttl_s=60)
    for k in range(3):
        s.add_sample("m", 0, StageSample(f"x.{k}", 0.0, 1.0, 10.0, "r", "pass"), maxlen=100)
        advance(0.01)
    first = s.stage_windows({("m", 0): None, ("m", 1): None}, since_s=0.0)
    assert [x.request_id for x in first[("m", 0)].samples] == ["x.0", "x.1", "x.2"]
    assert first[("m", 1)].samples == () and first[("m", 1)].cursor is None
    assert [x.replica_id for x in first[("m", 0)].replicas] == ["m-s0.here.1"] and first[("m", 1)].replicas == ()
    assert first[("m", 0)].backlog.waiting == 0
    cursor = first[("m", 0)].cursor
    assert s.stage_windows({("m", 0): cursor}, since_s=0.0)[("m", 0)].samples == ()   # nothing new: nothing read
    s.add_sample("m", 0, StageSample("x.3", 0.0, 1.0, 10.0, "r", "pass"), maxlen=100)
    later = s.stage_windows({("m", 0): cursor}, since_s=0.0)[("m", 0)]
    assert [x.request_id for x in later.samples] == ["x.3"] and later.cursor != cursor
    assert s.stage_windows({("m", 0): None}, since_s=time.time() + 3600)[("m", 0)].samples == ()


def test_the_control_planes_logs_read_back_in_order(store):
    s, advance = store
    s.add_placement(Placement("add", "m:1", "fewest replicas", "vs-0", "cold", "m-s1.vs-0.5", "cold", "light", 1.0), 100)
    s.add_placement(Placement("unplaced", "m:2", "no free slot", t=2.0), 100)
    assert [p.op for p in s.placements()] == ["add", "unplaced"] and s.placements()[0].server == "vs-0"
    s.add_placements([Placement("remove", "m:1", "crowded", "vs-0", t=3.0), Placement("add", "m:1", "key", t=4.0)], 100)
    assert [p.op for p in s.placements()] == ["add", "unplaced", "remove", "add"]
    for t in (1.0, 2.0, 3.0):
        s.add_decision("m", DecisionRecord(t, "quart", (1,), (2,), ("0",), ({"stage": "0", "replicas": 2},)), 100)
    assert [d.t for d in s.decisions("m")] == [3.0, 2.0, 1.0] and [d.t for d in s.decisions("m", count=1)] == [3.0]
    assert s.decisions("other") == []
    assert s.layout("m") == PIPELINED and s.layout_changes("m") == []
    s.set_layout("m", LayoutChange(5.0, "consolidating", "quiet"), 100)
    s.set_layout("m", LayoutChange(6.0, "whole", "caches moved"), 100)
    assert s.layout("m") == "whole" and [c.layout for c in s.layout_changes("m")] == ["consolidating", "whole"]
    s.add_cache_event("vs-0", CacheEvent("cache", "m:1", 10, 1.0), 100)
    advance(0.05)
    since = time.time() if isinstance(s, RedisStore) else s.clock()
    advance(0.05)
    s.add_cache_event("vs-0", CacheEvent("fork", "m:1", 10, 2.0, (("child", "11"),)), 100)
    assert [e.event for e in s.cache_events("vs-0")] == ["cache", "fork"]
    assert [e.detail for e in s.cache_events("vs-0", since_s=since)] == [(("child", "11"),)]


def test_zygotes_are_what_the_scheduler_counts_as_cached(store):
    s, _ = store
    s.publish_zygote(ZygoteRecord("vs-0", "m", "1-3", 42, 1000, ("ab",)))
    s.publish_zygote(ZygoteRecord("vs-0", "m", "3", 43, 500))
    s.publish_zygote(ZygoteRecord("vs-1", "m", "0", 44, 7))
    assert s.cached_stages("vs-0") == (frozenset({"m:1-3", "m:3"}), 1500)
    s.withdraw_zygote("vs-0", StageRef("m", 1, 3))
    assert s.cached_stages("vs-0") == (frozenset({"m:3"}), 500) and s.cached_stages("nowhere") == (frozenset(), 0)


def test_stage_cpus_and_the_sleep_flags(store):
    s, advance = store
    stage = StageRef("m", 1, 3)
    assert s.stage_cpus(stage) is None
    s.set_stage_cpus(stage, 2)
    s.set_stage_cpus(StageRef("m", 3, 4), 0.25)         # a container's quota may be a fraction
    assert (s.stage_cpus(stage), s.stage_cpus(StageRef("m", 3, 4))) == (2.0, 0.25)
    s.set_asleep("a", 1.0)
    s.set_asleep("b", 1.0)
    assert s.asleep(["a", "b", "c"]) == {"a", "b"} and not s.waking("a")
    s.wake("a", 2.0, waking_ttl_s=1)
    s.set_awake("b")
    assert s.asleep(["a", "b"]) == set() and s.waking("a") and not s.waking("b")
    advance(1.3)
    assert not s.waking("a")                             # waking lasts the entry's request timeout, then ends


def test_the_gateways_activity_per_model(store):
    s, _ = store
    assert s.activity() == {}
    s.set_activity({"a": Activity(10.5, 2), "b": Activity(11.0)})
    s.set_activity({"a": Activity(12.25, 0)})            # a later write replaces that model's only
    assert s.activity() == {"a": Activity(12.25, 0), "b": Activity(11.0, 0)}
