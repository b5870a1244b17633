"""A batch of decode steps stays one batch on its way round the pipeline, against a real
redis-server: the steps that the entry's requests send together leave in one transaction
(frontend/step_sender.py), and a stage replica woken by the first of a batch handed on in one
transaction takes the whole batch, not that first item alone (engine/transport.py). Broken,
either one splits a batch into groups that each read the stage's weights once a token."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
import redis
import redis.asyncio as aioredis
import torch

from contracts.stage import StageRef
from contracts.wire import MESSAGE_FIELD, Header, pack
from engine.batch_policy import new_item_slots
from engine.transport import StageTransport, ensure_group
from frontend.step_sender import StepSender
from runtime.ports import free_port
from state import keys

STEPS = 12


def _execs(r: redis.Redis) -> int:
    return _answered(r, "exec")


def _answered(r: redis.Redis, command: str) -> int:
    """Calls of `command` that Redis ran, less those it failed."""
    stats = r.info("commandstats").get(f"cmdstat_{command}", {})
    return int(stats.get("calls", 0)) - int(stats.get("failed_calls", 0))


def _message(i: int) -> bytes:
    header = Header(request_id=f"r{i}.1", model="m", stage=0, reply_to="nobody", deadline=time.time() + 60,
                    kind="decode", seq=f"r{i}")
    return pack(header, {"input_ids": torch.tensor([[i]])})


def test_steps_sent_in_the_same_turns_leave_in_one_transaction(redis_port):
    r = redis.Redis(port=redis_port)
    stream = "quart:test:steps"

    async def scenario() -> list:
        connection = aioredis.Redis(port=redis_port)
        sender = StepSender(lambda: _ready(connection))
        replies = [asyncio.get_running_loop().create_future() for _ in range(STEPS)]

        async def request(i: int):  # as a generation does: woken by its reply, then sends its next step
            await asyncio.wait_for(asyncio.shield(replies[i]), timeout=10)
            return await sender.xadd(stream, _message(i), nomkstream=False)

        tasks = [asyncio.create_task(request(i)) for i in range(STEPS)]
        await asyncio.sleep(0.05)
        before = _execs(r)
        for reply in replies:  # the reply reader answers a batch at once
            reply.set_result(None)
        ids = await asyncio.gather(*tasks)
        assert _execs(r) - before == 1, "the steps left in more than one transaction"
        gone = await sender.xadd("quart:test:gone", _message(0), nomkstream=True)
        await connection.aclose()
        return [*ids, gone]

    *ids, gone = asyncio.run(scenario())
    assert len(set(ids)) == STEPS and r.xlen(stream) == STEPS
    assert gone is None  # a stream that is gone (its replica is) answers None, as a lone XADD does


def test_a_failed_transaction_reaches_every_sender(redis_port):
    async def scenario() -> list:
        dead = aioredis.Redis(port=free_port(), socket_connect_timeout=1)
        sender = StepSender(lambda: _ready(dead))
        return await asyncio.gather(*(sender.xadd("s", _message(i), nomkstream=False) for i in range(3)),
                                    return_exceptions=True)

    outcomes = asyncio.run(scenario())
    assert all(isinstance(o, (aioredis.ConnectionError, OSError)) for o in outcomes), outcomes


def test_a_refused_step_fails_its_sender_alone(redis_port):
    redis.Redis(port=redis_port).set("quart:test:not-a-stream", "x")

    async def scenario() -> list:
        connection = aioredis.Redis(port=redis_port)
        sender = StepSender(lambda: _ready(connection))
        streams = ["quart:test:steps", "quart:test:not-a-stream", "quart:test:steps"]
        outcomes = await asyncio.gather(*(sender.xadd(s, _message(i), nomkstream=False) for i, s in enumerate(streams)),
                                        return_exceptions=True)
        await connection.aclose()
        return outcomes

    ok, refused, also_ok = asyncio.run(scenario())
    assert isinstance(refused, redis.ResponseError) and "WRONGTYPE" in str(refused)
    assert isinstance(ok, bytes) and isinstance(also_ok, bytes)


def _transport(redis_port: int) -> tuple[StageTransport, redis.Redis]:
    url = f"redis://127.0.0.1:{redis_port}/0"
    transport = StageTransport(url, StageRef("m", 1, 2), "m-s1.test.1", True, records_maxlen=100, reply_ttl_ms=10_000,
                               reclaim_idle_ms=10_000, stream_ttl_ms=60_000, on_first_work=lambda: None)
    transport.ensure_streams([])
    r = redis.Redis.from_url(url)
    ensure_group(r, transport.private)
    return transport, r


SLOTS_16 = [new_item_slots(16, n, 0) for n in range(17)]


@pytest.mark.parametrize("stream", ["private", "shared"])
def test_an_idle_replica_woken_by_a_batch_takes_all_of_it(redis_port, stream):
    """Decode steps on its own stream, or a burst of prefills on the stage's: one turn takes them all."""
    transport, r = _transport(redis_port)
    taken: list = []
    waiting = threading.Thread(target=lambda: taken.extend(
        transport.wait_for_work({transport.private: ">", transport.shared: ">"}, 16, SLOTS_16, 10_000)))
    waiting.start()
    time.sleep(0.3)  # the replica blocks on its streams, idle
    pipe = r.pipeline(transaction=True)  # the stage before hands its step's outputs on together
    for i in range(STEPS):
        pipe.xadd(getattr(transport, stream), {MESSAGE_FIELD: _message(i)})
    pipe.execute()
    waiting.join(timeout=10)
    assert sorted(w.header.seq for w in taken) == sorted(f"r{i}" for i in range(STEPS))
    assert transport.wait_for_work({transport.private: ">", transport.shared: ">"}, 4, [4, 3, 2, 1, 0], 1) == []


def test_a_woken_turn_takes_the_new_items_its_decode_steps_leave_slots_for_and_leaves_the_rest(redis_port):
    transport, r = _transport(redis_port)
    pipe = r.pipeline(transaction=True)
    for i in range(3):
        pipe.xadd(transport.private, {MESSAGE_FIELD: _message(i)})
    for i in range(3, 8):
        pipe.xadd(transport.shared, {MESSAGE_FIELD: _message(i)})
    pipe.execute()
    taken = transport.wait_for_work({transport.private: ">", transport.shared: ">"}, 4, [4, 3, 2, 1, 0], 1_000)
    # The read takes one of each stream (one more than the batch, as before); the take the other
    # two decode steps and the one new item that three decode steps leave a slot for.
    assert sorted(w.header.seq for w in taken) == ["r0", "r1", "r2", "r3", "r4"]
    taken = transport.wait_for_work({transport.private: ">", transport.shared: ">"}, 4, [4, 3, 2, 1, 0], 1_000)
    assert sorted(w.header.seq for w in taken) == ["r5", "r6", "r7"]


def test_a_turn_takes_its_decode_steps_then_the_slots_they_leave_in_one_round_trip(redis_port):
    transport, r = _transport(redis_port)
    for i in range(3):
        r.xadd(transport.private, {MESSAGE_FIELD: _message(i)})
    for i in range(3, 8):
        r.xadd(transport.shared, {MESSAGE_FIELD: _message(i)})
    calls = _answered(r, "evalsha")
    # The slots a batch of 4 leaves beside 0, 1, 2, ... decode steps, as new_item_slots says.
    taken = transport.take(4, [4, 3, 2, 1, 0])
    assert [w.header.seq for w in taken] == ["r0", "r1", "r2", "r3"]
    assert [w.stream for w in taken] == [transport.private] * 3 + [transport.shared]
    assert _answered(r, "evalsha") - calls == 1  # (a first call that Redis did not know the script of fails)
    assert [w.header.seq for w in transport.take(4, [0] * 5)] == []  # no slots: the shared stream is left alone
    assert [w.header.seq for w in transport.take(4, [2, 1, 0, 0, 0])] == ["r4", "r5"]
    # What it took is this replica's until acknowledged: pending in Redis and held.
    assert r.xpending(transport.private, keys.GROUP)["pending"] == 3
    assert r.xpending(transport.shared, keys.GROUP)["pending"] == 3
    assert len(transport.holding) == 6


def test_a_commit_takes_the_next_turns_items_in_its_own_transaction(redis_port):
    transport, r = _transport(redis_port)
    for i in range(2):
        r.xadd(transport.private, {MESSAGE_FIELD: _message(i)})
    done = transport.take(4, [4, 3, 2, 1, 0])
    for i in range(2, 4):
        r.xadd(transport.private, {MESSAGE_FIELD: _message(i)})
    r.xadd(transport.shared, {MESSAGE_FIELD: _message(4)})
    execs, evals = _execs(r), _answered(r, "eval")
    commit = transport.commit()
    commit.reply(done[0].header, {})
    commit.execute(done, then_take=(4, [4, 3, 2, 1, 0]))
    assert (_execs(r) - execs, _answered(r, "eval") - evals) == (1, 1)  # the take ran inside the transaction
    assert [w.header.seq for w in transport.taken] == ["r2", "r3", "r4"]
    assert r.llen("nobody") == 1  # the commit's writes ran
    assert r.xpending(transport.private, keys.GROUP)["pending"] == 2  # the acknowledged are gone, the taken pending
    assert {(w.stream, w.msg_id) for w in transport.taken} == transport.holding


def test_a_commit_whose_take_fails_still_writes_and_takes_nothing(redis_port):
    transport, r = _transport(redis_port)
    r.xadd(transport.private, {MESSAGE_FIELD: _message(0)})
    done = transport.take(4, [4, 3, 2, 1, 0])
    r.delete(transport.private)  # the private stream expired under it
    commit = transport.commit()
    commit.reply(done[0].header, {})
    commit.execute(done, then_take=(4, [4, 3, 2, 1, 0]))
    assert transport.taken is None and r.llen("nobody") == 1
    with pytest.raises(redis.ResponseError, match="NOGROUP"):  # the next turn's own take says why
        transport.take(4, [4, 3, 2, 1, 0])


async def _ready(connection: aioredis.Redis) -> aioredis.Redis:
    return connection
