"""Admission control at a model's entry: a new request is refused at once (429 with Retry-After)
when its first pass (a prefill, or a whole pass) would queue longer than QUART_ADMIT_WAIT_S
beyond what a pass takes, instead of joining a queue it would time out in. Two estimates, either
of which refuses:

- Little's law: the first passes in flight here (L) over the rate they complete at (X, over the
  current busy period, at most WINDOW_S) give the time a new one would spend, L/X. Ahead of
  time: the queue is refused before it forms.
- CoDel's signal: how long the oldest first pass still waiting has queued. It catches what the
  rate estimate misses (stages that stopped answering, a rate not measured yet).

The autoscaler still sees the queues (they grow up to the bound, which is above its target), so
it keeps scaling up. Pure: time comes in."""
from __future__ import annotations

import statistics
from collections import deque

SERVICE_WINDOW = 32     # passes whose service time makes "what a pass takes"
# Fewer first passes in flight than this are never refused: there is no queue to protect, and a
# stall (a replica killed while its items wait to be reclaimed) must not turn into refusals.
MIN_IN_FLIGHT = 4
WINDOW_S = 10.0         # completions that make the rate
MIN_RATE_S = 1.0        # the rate is known once the busy period is this long


class Admission:
    def __init__(self, max_wait_s: float) -> None:
        self.max_wait_s = max_wait_s  # 0 admits everything
        self._waiting: dict[str, float] = {}  # first passes sent and not answered: key -> when sent
        self._service_s: deque[float] = deque(maxlen=SERVICE_WINDOW)
        self._completed: deque[float] = deque()
        self._busy_since = 0.0

    @property
    def in_flight(self) -> int:
        """First passes sent and not answered yet."""
        return len(self._waiting)

    def sent(self, key: str, now: float) -> None:
        if not self._waiting:
            self._busy_since = now
        self._waiting[key] = now

    def answered(self, key: str, service_s: float | None, now: float) -> None:
        """`key`'s first pass came back (service_s: what its stages spent on it) or was given up."""
        if self._waiting.pop(key, None) is None:
            return
        if service_s is not None:
            self._service_s.append(service_s)
            self._completed.append(now)

    def _typical_s(self) -> float:
        return statistics.median(self._service_s) if self._service_s else 0.0

    def queued_s(self, now: float) -> float:
        """How long the oldest waiting first pass has queued beyond a typical pass's service."""
        if not self._waiting:
            return 0.0
        return max(0.0, now - min(self._waiting.values()) - self._typical_s())

    def predicted_s(self, now: float) -> float | None:
        """How long a first pass sent now would queue (L/X less a pass's service); None while the
        rate is not known."""
        since = max(now - WINDOW_S, self._busy_since)
        while self._completed and self._completed[0] < since:
            self._completed.popleft()
        if not self._waiting or now - since < MIN_RATE_S or not self._completed:
            return None
        rate = len(self._completed) / (now - since)
        return max(0.0, (len(self._waiting) + 1) / rate - self._typical_s())

    def refusal(self, now: float) -> float | None:
        """None to admit a new request; otherwise the seconds it should wait before retrying."""
        if self.max_wait_s <= 0 or len(self._waiting) < MIN_IN_FLIGHT:
            return None
        over = max(self.queued_s(now), self.predicted_s(now) or 0.0) - self.max_wait_s
        return None if over <= 0 else max(1.0, over)
