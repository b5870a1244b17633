"""A server's paced uplink and the order of its multicast sends (keysmanager/pacing.py), on a real
event loop: a send waits for its plan's earlier send from the same server, and not forever when
that one never comes; a link carries no more than its rate, each way."""
from __future__ import annotations

import asyncio
import threading
import time

from keysmanager.pacing import Link, SendOrder


def test_a_send_waits_for_its_plans_earlier_send_from_this_server():
    async def scenario() -> list[str]:
        order, done = SendOrder(Link(1e6)), []

        async def pull(round_: int, after: int) -> None:
            assert await order.turn("p1", after, grace_s=30, wait_s=30)
            done.append(f"r{round_}")
            await order.sent("p1", round_)

        later = asyncio.create_task(pull(2, 0))       # asks first, but its turn is after round 0
        await asyncio.sleep(0.2)
        assert not later.done()
        await asyncio.create_task(pull(0, -1))
        await asyncio.wait_for(later, 10)
        return done

    assert asyncio.run(scenario()) == ["r0", "r2"]


def test_another_plans_sends_do_not_count():
    async def scenario() -> bool:
        order = SendOrder(Link(1e6))
        await order.sent("p1", 0)
        waiting = asyncio.create_task(order.turn("p2", 0, grace_s=30, wait_s=30))
        await asyncio.sleep(0.2)
        return waiting.done()

    assert not asyncio.run(scenario())


def test_a_pull_waits_a_while_then_asks_again_and_the_grace_counts_from_the_plans_first_ask():
    async def scenario() -> tuple[bool, bool, float]:
        order = SendOrder(Link(1e6))
        started = time.monotonic()
        first = await order.turn("p1", 3, grace_s=0.6, wait_s=0.2)    # round 3 not sent, link idle 0.2 s
        while not await order.turn("p1", 3, grace_s=0.6, wait_s=0.2):  # asked again, and again ...
            pass
        return first, True, time.monotonic() - started                 # ... until the link idled 0.6 s

    first, went, waited = asyncio.run(scenario())
    assert not first and went and 0.6 <= waited < 5


def test_the_link_carries_no_more_than_its_rate():
    async def scenario() -> float:
        link = Link(1e6)
        started = time.monotonic()
        for _ in range(10):
            await link.send(100_000)
        return time.monotonic() - started

    # ten chunks of 0.1 s each: the last may start once nine have gone, less the burst allowance
    assert asyncio.run(scenario()) >= 0.9 - 0.02


def test_the_downlink_carries_no_more_than_its_rate_whoever_reads_through_it():
    link = Link(1e6)
    started = time.monotonic()

    def reads() -> None:
        for _ in range(5):
            link.take(100_000)

    threads = [threading.Thread(target=reads) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.monotonic() - started >= 0.9 - 0.02  # ten reads of 0.1 s each, whichever thread
