"""The embedded gateway's side of scale to zero, OpenFaaS's gateway's: it notes each model's
requests, publishes them each second (the autoscaler's idle rule decides when a model's stage
functions sleep, and wakes them when work waits in their streams: autoscaler/policy/arbitration.py),
and, as OpenFaaS's gateway scales from zero, wakes a function invoked at zero replicas (entry or
stage, put there by hand or by the idle rule) with the model's sleeping stage functions at once, on
the request's way in, while the gateway holds the request until a replica is ready. A model
that also has a whole-model function wakes in the layout HydraServe's Algorithm 1 chooses
(scheduler/wake_layout.py): whole where it gives its first token within the model's TTFT
objective, else as its stage functions."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

from contracts.stack import ZeroScaling, identity, is_whole
from runtime.functions import FunctionState
from scheduler.wake_layout import WakeChoice
from state.records import PIPELINED, WHOLE, Activity, LayoutChange
from state.store import Store

log = logging.getLogger("quart.activator")
PUBLISH_S = 1.0


Chooser = Callable[[str, list[FunctionState]], WakeChoice]


class Activator:
    def __init__(self, store: Store, initial: Callable[[FunctionState], int], waking_ttl_s: float,
                 choose: Chooser | None = None, records_maxlen: int = 10000) -> None:
        """`initial(fn)`: the replicas a function wakes to (its minimum); `waking_ttl_s`: how long
        the entry may admit requests behind a cold start (its request timeout); `choose(model,
        functions)`: the layout a model with a whole-model function wakes in (None: its stages)."""
        self.store, self.initial, self.waking_ttl_s = store, initial, waking_ttl_s
        self.choose, self.records_maxlen = choose, records_maxlen
        self.last_request: dict[str, float] = {}
        self.in_flight: dict[str, int] = {}
        self._published = 0.0

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

    def wake(self, functions: list[FunctionState], invoked: FunctionState, now: float | None = None) -> bool:
        """OpenFaaS's scale from zero: the invoked function back to its minimum if it is at zero,
        whatever put it there. For an entry, its model's stage functions at zero come back with it:
        all of them where the entry was at zero too (the model was put to sleep whole), else those
        their idle rule put there (a stage scaled to zero by hand while its entry runs stays there,
        as its operator asked). Stage functions wake only in the pipelined layout: at zero for a
        consolidated layout is not asleep. A model whose stage functions all sleep and whose
        whole-model function is at zero wakes in the layout `choose` picks. True if any function woke."""
        now = time.time() if now is None else now
        model = identity(invoked.deployment)[0]
        asleep = [fn for fn in functions if invoked.stage is None and fn.stage is not None and fn.stage.model == model
                  and not fn.desired and not is_whole(fn) and (not invoked.desired or _idles(fn))]
        if asleep and self.store.layout(model) != PIPELINED:
            asleep = []
        if asleep:
            asleep = self._layout(model, functions, asleep, now)
        woken = asleep + ([invoked] if not invoked.desired else [])
        if not woken:
            return False
        for fn in woken:
            fn.desired = self.initial(fn)
        self.store.wake(model, now, self.waking_ttl_s)
        self.touched(model, now)
        log.info("woke %s: %s", model, ", ".join(f"{fn.name}={fn.desired}" for fn in woken))
        return True

    def _layout(self, model: str, functions: list[FunctionState], asleep: list[FunctionState],
                now: float) -> list[FunctionState]:
        """The functions a sleeping model wakes as: its sleeping stage functions, or its whole
        function where it has one at zero, every stage function sleeps, and `choose` picks it."""
        mine = [fn for fn in functions if fn.stage is not None and fn.stage.model == model]
        whole = next((fn for fn in mine if is_whole(fn)), None)
        if self.choose is None or whole is None or whole.desired or len(asleep) < len(mine) - 1:
            return asleep
        try:
            choice = self.choose(model, functions)
        except ValueError as exc:  # no free slot anywhere: the stages wait for one, as before
            log.warning("%s wakes as its stage functions: %s", model, exc)
            return asleep
        self.store.set_layout(model, LayoutChange(now, WHOLE if choice.whole else PIPELINED, choice.reason),
                              self.records_maxlen)
        log.info("%s %s", model, choice.reason)
        return [whole] if choice.whole else asleep

    def publish(self, now: float | None = None) -> None:
        """Once a second: every model's requests, for the autoscaler's idle rule."""
        now = time.time() if now is None else now
        if now < self._published + PUBLISH_S:
            return
        self._published = now
        self.store.set_activity({m: Activity(t, self.in_flight.get(m, 0)) for m, t in self.last_request.items()})


def _idles(fn: FunctionState) -> bool:
    """Whether an idle rule may have put the function at zero (it is labelled for one)."""
    return ZeroScaling.from_labels(fn.deployment.get("labels") or {}).enabled
