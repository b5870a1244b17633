"""A server's links as the embedded runtime's virtual servers share one machine's loopback, and
the order its multicast sends go out in.

`Link`: what the KeysManager sends its peers goes out no faster than QUART_SERVER_BANDWIDTH
bytes/s, all its responses together (the uplink), and what it receives from its peers and the
model store comes in no faster than that (the downlink: the multicast's receiver and the
prefetcher read through it), so that several servers on one machine behave as several machines
with links of that speed. Written here because the pacing is of this server's own sends and
reads: a virtual clock per direction.

`SendOrder`: a multicast plan's rounds kept locally. Each pull of a plan names its round and the
round of the source's send before it, and waits until that one has gone out, so that the link
carries one block at a time in the plan's order, as the plan's rounds assume. Without it a holder
(which has every block) or a peer that is early serves several rounds' pulls at once, each at a
fraction of the link, and every server downstream of them waits (measured: 1.75× the plan's
time at N = 8). A pull waits here a while at most, then is told to ask again (the wait for a turn
can last the plan's earlier rounds, as long as a unicast's whole). A predecessor that never asks
(its receiver died, or took the block from a holder) holds the rest up no longer than the link
stays idle for `grace_s` once the plan has asked here."""
from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

# The plans whose sends a server remembers (a few rounds' numbers each).
PLANS_KEPT = 256


class Link:
    """One direction of a server's link: a virtual clock of when it is next free, which each
    chunk advances by its size (a chunk starts once the link has carried the ones before it).
    `send` paces the event loop's sends (the uplink), `take` a thread's reads (the downlink)."""

    def __init__(self, bytes_per_s: float, burst_s: float = 0.02) -> None:
        """`burst_s`: how far a chunk's start may lie in the past, so that a sleep that wakes late
        is made up by the next chunks instead of lowering the link's rate (a millisecond late on
        each of a block's 80 chunks cost 8 % of it)."""
        if bytes_per_s <= 0:
            raise ValueError(f"a link's speed is positive, not {bytes_per_s}")
        self.rate = bytes_per_s
        self.burst_s = burst_s
        self._free_at = 0.0
        self._lock = threading.Lock()

    def _reserve(self, size: int) -> float:
        """Seconds until `size` more bytes may start (the link is then busy with them for size/rate)."""
        with self._lock:
            now = time.monotonic()
            start = self._free_at if now - self._free_at < self.burst_s else now  # busy: keep its schedule
            self._free_at = start + size / self.rate
            return start - now

    async def send(self, size: int) -> None:
        """Returns when `size` more bytes may go out."""
        if (delay := self._reserve(size)) > 0:
            await asyncio.sleep(delay)

    def take(self, size: int) -> None:
        """Returns when `size` more bytes may come in (blocking the calling thread)."""
        if (delay := self._reserve(size)) > 0:
            time.sleep(delay)

    def idle_since(self, since: float) -> float:
        """How long the link has carried nothing since the monotonic time `since`."""
        with self._lock:
            return max(0.0, time.monotonic() - max(since, self._free_at))


@dataclass
class _Plan:
    asked: float                                  # when a pull of it first asked here (monotonic)
    sent: set[int] = field(default_factory=set)   # its rounds sent from here


class SendOrder:
    def __init__(self, uplink: Link) -> None:
        self.uplink = uplink
        self._plans: OrderedDict[str, _Plan] = OrderedDict()
        self._changed = asyncio.Condition()

    async def turn(self, plan: str, after: int, grace_s: float, wait_s: float) -> bool:
        """Whether this server's send of round `after` of `plan` has gone out (at once for
        after < 0), or the link has been idle `grace_s` since the plan first asked here, within
        `wait_s`; False if neither has come by then (the link is busy with the plan's earlier
        rounds: the puller asks again)."""
        if after < 0:
            return True
        until = time.monotonic() + wait_s
        async with self._changed:
            record = self._record(plan)
            while after not in record.sent:
                idle = self.uplink.idle_since(record.asked)
                left = min(grace_s - idle, until - time.monotonic())
                if idle >= grace_s:
                    return True
                if left <= 0:
                    return False
                try:
                    await asyncio.wait_for(self._changed.wait(), left)
                except TimeoutError:
                    pass
            return True

    async def sent(self, plan: str, round_: int) -> None:
        """Round `round_` of `plan` has gone out from here (or failed to: either way its
        successors need not wait for it)."""
        async with self._changed:
            self._record(plan).sent.add(round_)
            self._changed.notify_all()

    def _record(self, plan: str) -> _Plan:
        record = self._plans.get(plan)
        if record is None:
            record = self._plans[plan] = _Plan(time.monotonic())
            while len(self._plans) > PLANS_KEPT:
                self._plans.popitem(last=False)
        self._plans.move_to_end(plan)
        return record
