"""Whether a pipelined model should consolidate into whole-model replicas, or split back into its
stage functions (HydraServe §6.1, at stage level): pure, state in and decision out.

HydraServe's sliding window: the requests that arrived in each recent window predict the most
that may arrive in the next; with the requests already in the model, that says how many
whole-model replicas it needs (each serves `per_replica` at once, its batch). While that many
fit under the whole function's maximum, one whole replica per needed worker serves the model
with fewer replicas than the pipeline (and, on GPUs, faster: no hop between stages, one batch
instead of S) and the stage replicas are removed: their caches are gathered into it. When a burst needs more, the stage functions
come back, so that QUART scales the stage that limits the model on its own, and the whole
replicas are removed: their caches are split over the stages."""
from __future__ import annotations

import math
from dataclasses import dataclass

from state.records import CONSOLIDATING, PIPELINED, SPLITTING, WHOLE


@dataclass(frozen=True)
class LayoutRule:
    windows: int = 4              # windows the peak is taken over; a model this long warm may consolidate
    per_replica: int = 16         # requests one whole replica serves at once (its batch)
    max_whole: int = 1            # whole replicas the model may have
    window_s: float = 30.0        # how long each window is


@dataclass(frozen=True)
class LayoutState:
    layout: str
    counts: tuple[int, ...]       # requests that arrived in each finished window, oldest first
    current: int                  # requests so far in the window under way
    busy: int                     # requests in the model now (holding a cache, or queued)
    whole_desired: int            # replicas the whole function is asked for
    whole_live: int               # whole replicas serving
    stages_live: tuple[int, ...]  # replicas serving, per stage function


@dataclass(frozen=True)
class LayoutDecision:
    layout: str
    reason: str
    whole: int | None = None      # replicas for the whole function; None: leave it
    stages: int | None = None     # replicas for every stage function; None: leave them


def needed(state: LayoutState, rule: LayoutRule) -> int:
    """Whole replicas the model needs: the busiest recent window's arrivals (the one under way
    included) on top of what is in the model now, `per_replica` each."""
    peak = max((*state.counts[-rule.windows:], state.current))
    return max(1, math.ceil((state.busy + peak) / rule.per_replica))


def decide(state: LayoutState, rule: LayoutRule) -> LayoutDecision | None:
    """The next step of the layout, or None to stay as it is."""
    need = needed(state, rule)
    fits = need <= rule.max_whole
    why = f"{need} whole replica(s) needed of {rule.max_whole} allowed"
    if state.layout == PIPELINED:
        if state.whole_desired:
            return LayoutDecision(PIPELINED, "the pipeline serves: no whole replica", whole=0)
        if fits and len(state.counts) >= rule.windows:
            return LayoutDecision(CONSOLIDATING, f"consolidate: {why}", whole=need)
    elif state.layout == CONSOLIDATING:
        if not fits:
            return LayoutDecision(PIPELINED, f"stay pipelined: {why}", whole=0)
        if state.whole_live >= state.whole_desired > 0:
            return LayoutDecision(WHOLE, "whole replicas serving: the stages hand their caches over", stages=0)
    elif state.layout == WHOLE:
        if not fits:
            return LayoutDecision(SPLITTING, f"split: {why}", stages=1)
        if need != state.whole_desired:
            return LayoutDecision(WHOLE, why, whole=need)
    elif state.layout == SPLITTING:
        if all(state.stages_live):
            return LayoutDecision(PIPELINED, "stages serving: the whole replicas hand their caches over", whole=0)
    return None


@dataclass
class ArrivalWindows:
    """Requests entering a model, counted per window (HydraServe's sliding window); the first
    look only marks where counting starts."""
    window_s: float
    keep: int
    counts: tuple[int, ...] = ()
    current: int = 0
    started: float | None = None

    def add(self, now: float, starts: int) -> None:
        if self.started is None:
            self.started = now
            return
        while now >= self.started + self.window_s:
            self.counts = (*self.counts, self.current)[-self.keep:]
            self.current, self.started = 0, self.started + self.window_s
        self.current += starts
