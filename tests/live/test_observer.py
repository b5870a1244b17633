"""The autoscaler's Observer against a real redis-server: every stage function of every model in
one round trip (a script per chunk of stages), ranges read at their first stage, only new records read each tick with
the same state as a fresh read, and expired replicas not counted (and pruned)."""
from __future__ import annotations

import redis

from autoscaler.observe import Observer
from contracts.stage import StageRef
from state import keys
from state.records import ReplicaRecord, StageSample
from state.store import RedisStore

REFS = {"m": (StageRef("m", 0, 1), StageRef("m", 1, 3))}


def _record(r: redis.Redis, ref: StageRef, t: float, service_ms: float) -> None:
    r.xadd(keys.records_stream(ref.model, ref.first), StageSample("x.0", t, 2.0, service_ms, "live", "pass").encode(),
           id=f"{int(t * 1000)}-0")


def test_incremental_reads_see_what_a_fresh_read_sees(redis_port):
    r = redis.Redis(port=redis_port)
    now = 1_000_000.0
    for k in range(10):
        _record(r, REFS["m"][1], now - 9 + k, 50.0)
    RedisStore(r).register(ReplicaRecord("live", "m", 1, 2, "here", 1, cpus=2), ttl_s=60)
    r.sadd(keys.stage_replicas("m", 1), "expired")  # "expired" has no hash any more
    observer = Observer(RedisStore(r), REFS, window_s=10.0)
    first = observer.observe(now, {"m": [1, 3]}, 2.0)["m"]
    ranged = first.stages[1]
    assert ranged.arrival_rate == 1.0 and abs(ranged.service_time_s - 0.05) < 1e-9
    assert ranged.replicas == 3 and ranged.ready_replicas == 1 and ranged.cpus == 2.0
    assert r.smembers(keys.stage_replicas("m", 1)) == {b"live"}
    assert first.stages[0].arrival_rate == 0.0 and first.stages[0].ready_replicas == 0
    for k in range(5):                       # five seconds pass, five records arrive at 0.1 s
        _record(r, REFS["m"][1], now + 1 + k, 100.0)
    later = observer.observe(now + 5, {"m": [1, 3]}, 2.0)["m"]
    fresh = Observer(RedisStore(r), REFS, window_s=10.0).observe(now + 5, {"m": [1, 3]}, 2.0)["m"]
    assert later == fresh
    assert later.stages[1].arrival_rate == 1.1     # 6 old ones still in [now - 5, now], 5 new
