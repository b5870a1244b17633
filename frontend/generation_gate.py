"""The places in flight of a model's entry (the mechanism of frontend/objectives.py): a request
takes a ticket when it arrives (or is refused), waits for its place in earliest-deadline order,
reports each token it gets, and gives its place back when it ends.

An entry that would refuse a request while idle has measurements it cannot test any more: only
what it admits is measured, so steps once slow (replicas still compiling, a neighbour busy) would
refuse a workload of longer requests for good. Idle for a refusal's Retry-After, it admits the
next request whose deadline has not passed anyway and measures afresh, as a redeployed entry
does: at most one such request at a time, on capacity that was idle."""
from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from collections.abc import Callable

from frontend.objectives import HOPEFUL, RETRY_AFTER_S, Decision, Objectives, StepTimes, batch_bound, decide

log = logging.getLogger(__name__)


class Refused(Exception):
    def __init__(self, decision: Decision, deadline: float, why: str) -> None:
        super().__init__(f"predicted to finish {decision.completion_s - deadline:.1f} s after its deadline ({why})")
        self.decision = decision


class GenerationGate:
    def __init__(self, objectives: Objectives, clock: Callable[[], float] = time.time) -> None:
        self.objectives = objectives
        self.steps = StepTimes()
        self._clock = clock
        self._running: set[Ticket] = set()
        self._queue: list[tuple[float, int, Ticket]] = []  # (deadline, arrival order, ticket)
        self._order = itertools.count()
        self._idle_since: float | None = clock()

    @property
    def in_flight(self) -> int:
        return sum(t.weight for t in self._running)

    @property
    def waiting(self) -> int:
        """Requests queued for their place."""
        return sum(1 for _, _, t in self._queue if not t.gone)

    def bound(self) -> int:
        return batch_bound(self.steps, self.objectives.tpot_s)

    def enter(self, arrived: float, tokens: int, weight: int = 1, force: bool = False) -> Ticket:
        """A ticket for a request of `weight` sequences of up to `tokens` new tokens each, queued
        by its deadline; Refused, with a TTFT objective, when it is predicted to miss it (unless
        `force`)."""
        now = self._clock()
        deadline = self.objectives.deadline(arrived, tokens)
        if self.objectives.ttft_s > 0 and not force:
            try:
                self._check(now, deadline, tokens)
            except Refused as refused:
                if self._idle_since is None or now - self._idle_since < RETRY_AFTER_S or now >= deadline:
                    raise
                log.info("idle for %.1f s, yet this request is %s: measuring the steps afresh",
                         now - self._idle_since, refused)
                self.steps = StepTimes()
        self._idle_since = None
        ticket = Ticket(self, tokens, weight, now)
        heapq.heappush(self._queue, (deadline, next(self._order), ticket))
        self._grant()
        return ticket

    def _check(self, now: float, deadline: float, tokens: int) -> None:
        """Refused when a request predicted to run behind those running and those queued with an
        earlier deadline would miss its own."""
        bound = self.bound()
        tpot, tpot_now = (self.steps.tpot(n, HOPEFUL) or 0.0 for n in (bound, self.in_flight))
        running = [t.left * tpot_now for t in self._running for _ in range(t.weight)]
        ahead = [self.steps.prefill_s + max(0, t.tokens - 1) * tpot
                 for d, _, t in sorted(self._queue) for _ in range(t.weight) if d <= deadline]
        decision = decide(now, deadline, tokens, bound, self.steps, running, ahead)
        if not decision.admit:
            raise Refused(decision, deadline, f"{len(running)} running, {len(ahead)} queued before it, at most {bound}"
                                              f" at once, hopefully {tpot * 1000:.0f} ms a token")

    def _grant(self) -> None:
        bound = self.bound()
        while self._queue:
            ticket = self._queue[0][2]
            if ticket.gone:
                heapq.heappop(self._queue)
                continue
            # One request at least always runs, however wide: a place bound below its width must not starve it.
            if self._running and self.in_flight + ticket.weight > bound:
                return
            heapq.heappop(self._queue)
            self._running.add(ticket)
            ticket.granted_at = self._clock()
            if not ticket.placed.done():
                ticket.placed.set_result(None)

    def _release(self, ticket: Ticket) -> None:
        ticket.gone = True
        self._running.discard(ticket)
        self._grant()
        if not self._running and not self.waiting:
            self._idle_since = self._clock()


class Ticket:
    """A request's place: `async with ticket` waits for it (TimeoutError past `wait_s`), and
    gives it back on leaving; `token()` after each token it gets."""

    def __init__(self, gate: GenerationGate, tokens: int, weight: int, arrived: float) -> None:
        self.gate, self.tokens, self.weight, self.arrived = gate, tokens, weight, arrived
        self.left = float(tokens)
        self.placed: asyncio.Future = asyncio.get_running_loop().create_future()
        self.granted_at: float | None = None
        self.gone = False
        self._last: float | None = None
        self._decode: tuple[float, float | None] | None = None  # its first token's time, the line's TPOT then

    @property
    def queued_s(self) -> float:
        return (self.gate._clock() if self.granted_at is None else self.granted_at) - self.arrived

    async def wait(self, wait_s: float) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(self.placed), timeout=max(0.0, wait_s))
        except BaseException:
            self.close()
            raise

    def token(self, choice: int = 0) -> None:
        """One more token of the request's sequence `choice` came back; the first sequence's
        tokens time the steps (the others run in the same steps)."""
        if choice:
            return
        now = self.gate._clock()
        if self._last is None:
            self.gate.steps.prefill(now - (now if self.granted_at is None else self.granted_at))
            self._decode = (now, self.gate.steps.line(self.gate.in_flight))
        else:
            self.gate.steps.step(self.gate.in_flight, now - self._last, self)
        self._last = now
        self.left = max(0.0, self.left - 1.0)

    def close(self) -> None:
        if self.gone:
            return
        steps = int(self.tokens - self.left) - 1  # after its first token: `left` counts them down
        if self._decode and self._decode[1] and steps >= 3:  # what its decode took against the line's
            self.gate.steps.took(self._decode[1], (self._last - self._decode[0]) / steps)
        self.gate._release(self)
