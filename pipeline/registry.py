"""Replica registration in Redis: a hash per replica that lives only while its heartbeat renews it."""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

import redis

from contracts import keys
from contracts.stage import StageRef


@dataclass
class ReplicaInfo:
    replica_id: str
    model: str
    stage_start: int
    stage_end: int
    server: str
    pid: int
    device: str
    cpus: int
    started_by: str
    started_at: float

    def stages(self) -> range:
        return range(self.stage_start, self.stage_end)


def register(r: redis.Redis, info: ReplicaInfo, ttl_s: float) -> None:
    pipe = r.pipeline()
    key = keys.replica(info.replica_id)
    pipe.hset(key, mapping={**{k: str(v) for k, v in asdict(info).items()}, "last_seen": str(time.time())})
    pipe.pexpire(key, int(ttl_s * 1000))
    for stage in info.stages():
        pipe.sadd(keys.stage_replicas(info.model, stage), info.replica_id)
    pipe.execute()


def heartbeat(r: redis.Redis, info: ReplicaInfo, ttl_s: float) -> None:
    """Renews the registration; re-creates it if it expired meanwhile (a long pause)."""
    key = keys.replica(info.replica_id)
    if not r.pexpire(key, int(ttl_s * 1000)):
        register(r, info, ttl_s)
        return
    r.hset(key, "last_seen", str(time.time()))


def deregister(r: redis.Redis, info: ReplicaInfo) -> None:
    pipe = r.pipeline()
    pipe.delete(keys.replica(info.replica_id))
    for stage in info.stages():
        pipe.srem(keys.stage_replicas(info.model, stage), info.replica_id)
    pipe.execute()


def live_replicas(r: redis.Redis, model: str, stage: int) -> list[dict[str, str]]:
    """Registered replicas of a stage whose heartbeat is current; prunes the expired ones."""
    return live_among(r, {(model, stage): r.smembers(keys.stage_replicas(model, stage))})[(model, stage)]


def live_among(r: redis.Redis, members: dict[tuple[str, int], set[bytes]]) -> dict[tuple[str, int], list[dict[str, str]]]:
    """Of the replica ids each (model, stage) set holds, the registrations still current, read in
    one pipelined round trip; the expired ids are pruned from their sets."""
    ids = {key: sorted(m.decode() for m in ms) for key, ms in members.items()}
    pipe = r.pipeline(transaction=False)
    for rids in ids.values():
        for rid in rids:
            pipe.hgetall(keys.replica(rid))
    found = iter(pipe.execute())
    out, prune = {}, r.pipeline(transaction=False)
    for (model, stage), rids in ids.items():
        got = [(rid, next(found)) for rid in rids]
        out[(model, stage)] = [{k.decode(): v.decode() for k, v in data.items()} for _, data in got if data]
        dead = [rid for rid, data in got if not data]
        if dead:
            prune.srem(keys.stage_replicas(model, stage), *dead)
    prune.execute()
    return out


def key_stage_ranges(r: redis.Redis) -> list[StageRef]:
    """Every key stage the autoscaler has published, in every model."""
    wanted = []
    for key in r.scan_iter(match=keys.KEY_STAGES_PATTERN, count=100):
        model = key.decode().rsplit(":", 1)[1]
        wanted += [StageRef.parse(model, stages.decode()) for stages in r.smembers(key)]
    return sorted(wanted)


def cached_stages(r: redis.Redis, server: str) -> tuple[frozenset[str], int]:
    """The "model:stages" a server's KeysManager holds, and their bytes."""
    members = sorted(m.decode() for m in r.smembers(keys.zygotes(server)))
    pipe = r.pipeline()
    for member in members:
        pipe.hget(keys.zygote(server, StageRef.from_key(member)), "bytes")
    sizes = pipe.execute()
    return frozenset(members), sum(int(b) for b in sizes if b is not None)


def stream_backlog(r: redis.Redis, model: str, stage: int) -> tuple[int, int]:
    """(waiting, in flight) of a stage's stream: items no replica has taken yet, and items a
    replica holds and has not acknowledged."""
    stream = keys.stage_stream(model, stage)
    try:
        in_flight = int(r.xpending(stream, keys.GROUP)["pending"])
    except redis.ResponseError:  # no group yet: nothing has been delivered
        in_flight = 0
    return max(0, r.xlen(stream) - in_flight), in_flight


def record_start_failure(r: redis.Redis, stage: StageRef, reason: str, ttl_s: float) -> None:
    """A replica of `stage` could not start (its shard failed its checksum, or is nowhere): the
    reason, for the requests that wait on it (kept `ttl_s`)."""
    key = keys.start_failures(stage.model)
    pipe = r.pipeline()
    pipe.hset(key, str(stage.first), json.dumps({"reason": reason, "at": time.time()}))
    pipe.expire(key, max(1, int(ttl_s)))
    pipe.execute()



def record_cold_start(r: redis.Redis | redis.client.Pipeline, stage: StageRef, record: dict[str, float]) -> None:
    """A replica of `stage` loaded its shards itself: when each step of its start ended (`r` may
    be a pipeline the caller runs)."""
    r.hset(keys.coldstarts(stage.model), str(stage.first), json.dumps(record))


def after_fetch_s(r: redis.Redis, stage: StageRef, stages: list[StageRef], samples: int = 50) -> float:
    """What follows a cold start's fetch before the first token, as measured: this stage's
    latest load after its bytes were in, plus the model's prefill pass (each stage's median
    prefill service time over its latest records); 0 for what was never measured."""
    pipe = r.pipeline(transaction=False)
    pipe.hget(keys.coldstarts(stage.model), str(stage.first))
    for s in stages:
        pipe.xrevrange(keys.records_stream(s.model, s.first), count=samples)
    raw, *records = pipe.execute()
    load = 0.0
    if raw:
        cold = json.loads(raw)
        load = max(0.0, cold.get("loaded_at", 0.0) - cold.get("fetched_at", 0.0))
    prefill = 0.0
    for entries in records:
        times = sorted(float(f[b"s"]) for _, f in entries if f.get(b"k") == b"prefill")
        prefill += times[len(times) // 2] / 1000.0 if times else 0.0
    return load + prefill
