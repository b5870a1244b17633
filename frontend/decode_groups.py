"""Decode steps kept in one group per route: a step whose sequence came back while steps sent
before that are still out on the same replicas waits for them (a bounded time), so that they all
set out together and every stage runs them as one batch.

Why: requests that start at different times come back from the last stage at different times,
and each group then crosses the pipeline on its own. A decode step is memory-bound, so each group
costs the stages a read of their weights: at 4 concurrent requests on a 2-core host, two groups of
two made a token take twice as long as one request alone. Waiting once, for at most one round,
merges the groups for the rest of their requests (the step sender then sends them in one
transaction, frontend/step_sender.py).

The order of events is what matters, not their times: a step waits only for steps sent before its
own sequence's previous step came back (those it can catch), never for those sent after (they set
out with it). Events are numbered by one counter."""
from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field

Route = tuple[tuple[str, str], ...]


def route_key(route: dict[str, str]) -> Route:
    """The replicas a decode step crosses, as a key: steps merge only on the same replicas."""
    return tuple(sorted(route.items()))


@dataclass
class _Held:
    came_back: int                     # when its sequence's previous step came back
    released: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class DecodeGroups:
    """Which steps are out on which replicas, and the decode steps waiting to join them. Every
    method runs on the event loop without awaiting, except `wait_for_group`."""

    def __init__(self, max_batch: int, enabled: bool = True) -> None:
        self.max_batch, self.enabled = max_batch, enabled
        self._clock = itertools.count()
        self._out: dict[str, tuple[Route | None, int, str]] = {}  # step id -> (its route, when sent, its sequence)
        self._came_back: dict[str, int] = {}                      # sequence -> when its latest step came back
        self._route_of: dict[str, Route] = {}                     # sequence -> the route of its latest decode step
        self._held: dict[Route, list[_Held]] = {}

    def sent(self, step_id: str, seq: str, route: dict[str, str] | None) -> None:
        """A step of `seq` set out: a decode step on `route`, or a prefill (None: its replicas are
        not known yet, so it holds no one back)."""
        if self.enabled:
            self._out[step_id] = (route_key(route) if route else None, next(self._clock), seq)

    def answered(self, step_id: str) -> None:
        """Its answer came (or it was given up on): it no longer holds anyone back. Called by the
        reply reader as each answer arrives, before the requests it wakes run, so that every step
        a batch answered counts as come back before any of them sends again."""
        out = self._out.pop(step_id, None)
        if out is None:
            return
        key, _, seq = out
        self._came_back[seq] = next(self._clock)
        if key is not None:
            self._route_of[seq] = key
            self._release(key)

    def forget(self, seq: str) -> None:
        """The sequence sends no more steps."""
        self._came_back.pop(seq, None)
        self._route_of.pop(seq, None)

    async def wait_for_group(self, seq: str, route: dict[str, str], limit_s: float) -> None:
        """Before `seq` sends its next decode step on `route`: waits while steps sent before its
        previous one came back are still out on the same replicas (at most `limit_s`), unless the
        group would then be more than the stages run as one batch, or those steps are fewer than
        the sequences back and waiting to send (the smaller group waits for the larger, not the
        larger for the smaller)."""
        came_back = self._came_back.get(seq)
        key = route_key(route)
        blocking = [] if came_back is None else self._blocking(key, came_back)
        if not blocking or limit_s <= 0:
            return
        # Its own group: the sequences on these replicas that came back since the first of those it
        # would wait for set out, whether or not they have gone again.
        group = sum(1 for s, k in self._route_of.items() if k == key and self._came_back.get(s, -1) > min(blocking))
        out = sum(1 for k, _, _ in self._out.values() if k == key)
        if out + group > self.max_batch or len(blocking) < group:
            return
        held = self._held.setdefault(key, [])
        entry = _Held(came_back)
        held.append(entry)
        try:
            await asyncio.wait_for(asyncio.shield(entry.released), timeout=limit_s)
        except TimeoutError:
            pass
        finally:
            held.remove(entry)
            if not held:
                self._held.pop(key, None)

    def _blocking(self, key: Route, came_back: int) -> list[int]:
        """When the steps out on `key` that were sent before `came_back` were sent."""
        return [sent for k, sent, _ in self._out.values() if k == key and sent < came_back]

    def _release(self, key: Route) -> None:
        for entry in self._held.get(key, []):
            if not entry.released.done() and not self._blocking(key, entry.came_back):
                entry.released.set_result(None)
