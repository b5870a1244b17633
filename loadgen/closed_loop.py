"""Closed-loop load: a few clients, each sending its next request when the last one answered,
until stopped; every request's send time, status and answer recorded. For faults: what happened
to each request around the moment something was killed."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from contracts.http_client import GatewayClient


@dataclass(frozen=True)
class Outcome:
    sent: float          # time.monotonic() when it left
    answered: float
    status: int          # 0: no HTTP answer at all
    body: dict


class ClosedLoop:
    def __init__(self, url: str, function: str, body: dict, clients: int = 3, timeout_s: float = 150.0) -> None:
        self.client = GatewayClient(url, timeout=timeout_s)
        self.function, self.body = function, body
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]

    def _run(self) -> None:
        while not self._stop.is_set():
            sent = time.monotonic()
            try:
                reply = self.client.invoke(self.function, self.body)
                body = reply.json() if reply.body else {}
                self.outcomes.append(Outcome(sent, time.monotonic(), reply.status, body))
            except (OSError, ValueError) as exc:
                self.outcomes.append(Outcome(sent, time.monotonic(), 0, {"error": str(exc)}))

    def ok_after(self, t: float) -> Outcome | None:
        """The first request sent after `t` that was answered 200."""
        return min((o for o in self.outcomes if o.sent > t and o.status == 200), key=lambda o: o.answered, default=None)

    def __enter__(self) -> ClosedLoop:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=180)
