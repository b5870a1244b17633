"""The DAG join against a real redis-server: a request reaches the join's stream once, when its
last part is in, whatever order the parts come in and however often one is delivered; the join's
replica gets every part and every branch's timings once; the parts are gone once it hands the
request on, and expire if it never does."""
from __future__ import annotations

import time

import redis
import torch

from contracts.wire import MESSAGE_FIELD, Header, StageTiming, unpack
from engine.join import Joins
from state import keys

MODEL = "dag"


def part(source: int, value: float) -> tuple[Header, dict[str, torch.Tensor]]:
    header = Header("req-1", MODEL, 7, "reply", time.time() + 60,
                    timings=[StageTiming(0, "r0", 1.0, 2.0), StageTiming(source, f"r{source}", 3.0, 4.0)])
    return header, {"hidden": torch.full((1, 2, 4), value)}


def send(r: redis.Redis, joins: Joins, source: int) -> None:
    header, tensors = part(source, float(source))
    pipe = r.pipeline(transaction=True)
    joins.send_part(pipe, header, tensors, source, parts=3)
    pipe.execute()


def test_a_request_joins_once_with_every_part(redis_port):
    r = redis.Redis(port=redis_port)
    joins = Joins(r, MODEL, ttl_ms=60_000)
    stream = keys.stage_stream(MODEL, 7)
    send(r, joins, 6)
    send(r, joins, 4)
    send(r, joins, 4)  # delivered twice: counts once
    assert r.xlen(stream) == 0
    send(r, joins, 5)
    send(r, joins, 5)
    assert r.xlen(stream) == 1
    (_, fields), = r.xrange(stream)
    header, tensors = unpack(fields[MESSAGE_FIELD])
    assert header.stage == 7 and tensors == {}
    header, parts = joins.collect(header, [4, 5, 6])
    assert [t.stage for t in header.timings] == [0, 4, 5, 6]
    assert {s: p["hidden"][0, 0, 0].item() for s, p in parts.items()} == {4: 4.0, 5: 5.0, 6: 6.0}
    pipe = r.pipeline(transaction=True)
    joins.done(pipe, header, 7)
    pipe.execute()
    assert r.keys(keys.join_parts(MODEL, 7, "*")) == []
    # Parts of a request whose join never comes expire.
    pipe = r.pipeline(transaction=True)
    Joins(r, MODEL, ttl_ms=200).send_part(pipe, *part(4, 1.0), 4, parts=3)
    pipe.execute()
    time.sleep(0.5)
    assert r.keys(keys.join_parts(MODEL, 7, "*")) == []
