"""Admission control at a model's entry, with CoDel's signal: how long the oldest request still
waiting for its first pass (a prefill, or a whole pass) has queued beyond what a pass takes. Past
QUART_ADMIT_WAIT_S the stages are not keeping up, and a new request is refused at once with 429
and a Retry-After instead of joining a queue it would time out in. The autoscaler still sees the
queues (they are allowed to grow to the bound), so it keeps scaling up. Pure: time comes in."""
from __future__ import annotations

import statistics
from collections import deque

# Passes whose service time makes the "what a pass takes" estimate.
SERVICE_WINDOW = 32


class Admission:
    def __init__(self, max_wait_s: float) -> None:
        self.max_wait_s = max_wait_s  # 0 admits everything
        self._waiting: dict[str, float] = {}  # first passes sent and not answered: key -> when sent
        self._service_s: deque[float] = deque(maxlen=SERVICE_WINDOW)

    def sent(self, key: str, now: float) -> None:
        self._waiting[key] = now

    def answered(self, key: str, service_s: float | None) -> None:
        """`key`'s first pass came back (service_s: what its stages spent on it) or was given up."""
        self._waiting.pop(key, None)
        if service_s is not None:
            self._service_s.append(service_s)

    def queued_s(self, now: float) -> float:
        """How long the oldest waiting first pass has queued beyond a typical pass's service."""
        if not self._waiting:
            return 0.0
        typical = statistics.median(self._service_s) if self._service_s else 0.0
        return max(0.0, now - min(self._waiting.values()) - typical)

    def refusal(self, now: float) -> float | None:
        """None to admit a new request; otherwise the seconds it should wait before retrying."""
        if self.max_wait_s <= 0:
            return None
        over = self.queued_s(now) - self.max_wait_s
        return None if over <= 0 else max(1.0, over)
