"""The embedded gateway's scale to zero and back (`autoscaler/policy/idle.py` decides): it notes
each model's latest request, puts the stage functions labelled for it to zero replicas once the
model is idle, and wakes them all when a request comes (at once, on the request's way in) or when
work waits in a stage's stream (a request that reached an entry some other way)."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

from autoscaler.policy.idle import ModelActivity, ZeroScaling, decide
from contracts.stack import is_whole
from runtime.functions import FunctionState
from state.records import PIPELINED
from state.store import Store

log = logging.getLogger("quart.idler")
CHECK_S = 1.0


class Idler:
    def __init__(self, store: Store, initial: Callable[[FunctionState], int], waking_ttl_s: float) -> None:
        """`initial(fn)`: the replicas a function wakes to (its minimum); `waking_ttl_s`: how long
        the entry may admit requests behind a cold start (its request timeout)."""
        self.store, self.initial, self.waking_ttl_s = store, initial, waking_ttl_s
        self.last_request: dict[str, float] = {}
        self.in_flight: dict[str, int] = {}
        self._checked = 0.0

    def touched(self, model: str, now: float | None = None) -> None:
        self.last_request[model] = time.time() if now is None else now

    def started(self, model: str) -> None:
        """A request of `model` came in: it counts as work until it is answered (a generation's
        decode steps pass through no shared stream, so the streams alone would look idle)."""
        self.touched(model)
        self.in_flight[model] = self.in_flight.get(model, 0) + 1

    def finished(self, model: str) -> None:
        self.touched(model)  # idleness counts from the last answer
        self.in_flight[model] -= 1

    @staticmethod
    def sleepers(functions: list[FunctionState], model: str,
                 at_zero: bool = False) -> list[tuple[FunctionState, ZeroScaling]]:
        """`model`'s stage functions labelled to scale to zero (`at_zero`: only those at zero
        now, asked on every request, so their labels are read only then), with their labels."""
        mine = (fn for fn in functions if fn.stage is not None and fn.stage.model == model
                and not (at_zero and fn.desired) and not is_whole(fn))  # the layout controller's
        labelled = [(fn, ZeroScaling.from_labels(fn.deployment.get("labels") or {})) for fn in mine]
        return [(fn, z) for fn, z in labelled if z.enabled]

    def wake(self, functions: list[FunctionState], model: str, now: float | None = None) -> bool:
        """Every sleeping stage function of `model` back to its minimum; True if any was asleep."""
        now = time.time() if now is None else now
        asleep = [fn for fn, _ in self.sleepers(functions, model, at_zero=True)]
        if not asleep or self.consolidated(model):
            return False
        for fn in asleep:
            fn.desired = self.initial(fn)
        self.store.wake(model, now, self.waking_ttl_s)
        self.touched(model, now)
        log.info("woke %s: %s", model, ", ".join(f"{fn.name}={fn.desired}" for fn in asleep))
        return True

    def step(self, functions: list[FunctionState], now: float | None = None) -> list[str]:
        """Once a second: each model's sleep or wake; the models whose desired counts changed."""
        now = time.time() if now is None else now
        if now < self._checked + CHECK_S:
            return []
        self._checked = now
        changed = []
        for model in sorted({fn.stage.model for fn in functions if fn.stage is not None}):
            labelled = self.sleepers(functions, model)
            if not labelled or self.consolidated(model):
                continue
            fns = [fn for fn, _ in labelled]
            activity = ModelActivity(self.last_request.setdefault(model, now), min(z.idle_s for _, z in labelled),
                                     sum(fn.desired for fn in fns), self.in_flight.get(model, 0) + self._work(fns))
            decision = decide(now, activity)
            if decision == "sleep":
                for fn in fns:
                    fn.desired = 0
                self.store.set_asleep(model, now)
                log.info("%s idle for %.0f s: its stage functions scale to zero", model, now - activity.last_request_at)
                changed.append(model)
            elif decision == "wake" and self.wake(functions, model, now):
                changed.append(model)
            elif decision is None and activity.replicas > 0:
                self.store.set_awake(model)  # scaled up by hand: the autoscaler's again
        return changed

    def consolidated(self, model: str) -> bool:
        """Whether the model is served by its whole-model function (or on its way to or from it):
        its stage functions are at zero for the layout controller, not for idleness."""
        return self.store.layout(model) != PIPELINED

    def _work(self, fns: list[FunctionState]) -> int:
        return sum(b.waiting + b.in_flight for b in (self.store.backlog(fn.stage.model, fn.stage.first) for fn in fns))
