"""frontend/decode_groups.py: decode steps that came back apart set out together."""
import asyncio

import pytest

from frontend.decode_groups import DecodeGroups

ROUTE = {"0": "s0-a", "1": "s1-a"}
OTHER = {"0": "s0-b", "1": "s1-a"}


def run(coro):
    return asyncio.run(coro)


async def _waited(groups: DecodeGroups, seq: str, route: dict, limit_s: float = 5.0) -> float:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await groups.wait_for_group(seq, route, limit_s)
    return loop.time() - t0


def test_a_group_that_came_back_first_waits_for_the_other_and_they_set_out_together():
    async def scenario():
        groups = DecodeGroups(max_batch=16)
        for seq in ("a1", "b1", "b2"):
            groups.sent(f"{seq}.0", seq, ROUTE)
        groups.answered("a1.0")
        wait = asyncio.create_task(_waited(groups, "a1", ROUTE))
        await asyncio.sleep(0.05)
        assert not wait.done(), "a1 went while b1 and b2 were still out"
        groups.answered("b1.0")
        groups.answered("b2.0")
        for seq in ("b1", "b2"):  # the last to come back do not wait
            assert await _waited(groups, seq, ROUTE) < 0.01
        assert await wait < 1.0   # released by their answers, not by the limit
    run(scenario())


def test_the_larger_group_does_not_wait_for_the_smaller_one_the_smaller_waits_for_it():
    async def scenario():
        groups = DecodeGroups(max_batch=16)
        for seq in ("a1", "a2", "b1"):
            groups.sent(f"{seq}.0", seq, ROUTE)
        groups.answered("a1.0")
        groups.answered("a2.0")
        for seq in ("a1", "a2"):
            assert await _waited(groups, seq, ROUTE) < 0.01, "two waited for one"
            groups.sent(f"{seq}.1", seq, ROUTE)
        groups.answered("b1.0")
        wait = asyncio.create_task(_waited(groups, "b1", ROUTE))
        await asyncio.sleep(0.05)
        assert not wait.done(), "b1 went while a1 and a2, sent before it came back, were out"
        groups.answered("a1.1")
        groups.answered("a2.1")
        assert await wait < 1.0
    run(scenario())


def test_steps_that_came_back_together_do_not_wait_for_each_other():
    async def scenario():
        groups = DecodeGroups(max_batch=16)
        for seq in ("a", "b", "c"):
            groups.sent(f"{seq}.0", seq, ROUTE)
        for seq in ("a", "b", "c"):
            groups.answered(f"{seq}.0")
        for seq in ("a", "b", "c"):  # each sends as the one before it is out again
            assert await _waited(groups, seq, ROUTE) < 0.01
            groups.sent(f"{seq}.1", seq, ROUTE)
    run(scenario())


def test_steps_on_other_replicas_and_prefills_hold_no_one_back():
    async def scenario():
        groups = DecodeGroups(max_batch=16)
        groups.sent("a.0", "a", ROUTE)
        groups.sent("b.0", "b", OTHER)
        groups.sent("p.0", "p", None)  # a prefill: its replicas are not known yet
        groups.answered("a.0")
        assert await _waited(groups, "a", ROUTE) < 0.01
    run(scenario())


def test_a_step_waits_at_most_its_limit_for_one_that_never_comes_back():
    async def scenario():
        groups = DecodeGroups(max_batch=16)
        groups.sent("a.0", "a", ROUTE)
        groups.sent("stuck.0", "stuck", ROUTE)
        groups.answered("a.0")
        waited = await _waited(groups, "a", ROUTE, limit_s=0.2)
        assert 0.15 < waited < 2.0
        assert not groups._held  # nothing left behind
    run(scenario())


def test_no_waiting_for_a_group_larger_than_a_batch():
    async def scenario():
        groups = DecodeGroups(max_batch=2)
        for seq in ("a", "b", "c"):
            groups.sent(f"{seq}.0", seq, ROUTE)
        groups.answered("a.0")
        assert await _waited(groups, "a", ROUTE) < 0.01  # b and c are out: a batch of 3 > 2
    run(scenario())


def test_switched_off_nothing_waits():
    async def scenario():
        groups = DecodeGroups(max_batch=16, enabled=False)
        groups.sent("a.0", "a", ROUTE)
        groups.sent("b.0", "b", ROUTE)
        groups.answered("a.0")
        assert await _waited(groups, "a", ROUTE) < 0.01
    run(scenario())


def test_a_cancelled_wait_leaves_nothing_behind_and_forget_drops_the_sequence():
    async def scenario():
        groups = DecodeGroups(max_batch=16)
        groups.sent("a.0", "a", ROUTE)
        groups.sent("b.0", "b", ROUTE)
        groups.answered("a.0")
        wait = asyncio.create_task(groups.wait_for_group("a", ROUTE, 5.0))
        await asyncio.sleep(0.02)
        wait.cancel()  # the client went away
        with pytest.raises(asyncio.CancelledError):
            await wait
        assert not groups._held
        groups.forget("a")
        assert await _waited(groups, "a", ROUTE) < 0.01  # no record of a's last answer: nothing to wait for
    run(scenario())
