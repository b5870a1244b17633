"""Objective-aware admission of generations at a model's entry (pure: state in, decision out).

A model may have a TTFT and a TPOT objective (QUART_TTFT_OBJECTIVE_S, QUART_TPOT_OBJECTIVE_S, set
per entry function in the stack). Continuous batching spreads every decode step over all the
sequences in flight, so a burst let in at once makes every request late. The entry therefore:

- bounds the sequences in flight to the most whose time per output token, as measured here
  (a line fitted to recent steps against the number in flight), stays within the TPOT objective,
  starting from one and at most doubling past the most it has measured;
- queues the rest in earliest-deadline order (a request's deadline: its arrival plus the TTFT
  objective plus its tokens at the TPOT objective, within the request timeout);
- with a TTFT objective, refuses (429) only a request whose predicted completion (its wait for a
  place, its prefill, its tokens at the bounded batch's TPOT) is past its deadline: what can
  still meet it waits.

Without objectives nothing is bounded or refused here: a request waits up to the request timeout
(vLLM's and OpenFaaS's behaviour), and only the stages' KV budgets refuse."""
from __future__ import annotations

import heapq
import math
import statistics
from collections import deque
from dataclasses import dataclass

WINDOW = 256        # recent decode steps the TPOT line is fitted to
PREFILLS = 32       # recent prefills whose median is "a prefill"
MAX_BOUND = 256     # sequences in flight at most, with a TPOT objective


@dataclass(frozen=True)
class Objectives:
    ttft_s: float = 0.0   # 0: none
    tpot_s: float = 0.0   # 0: none
    timeout_s: float = 120.0

    def deadline(self, arrived: float, tokens: int) -> float:
        """When a request of `tokens` new tokens that arrived at `arrived` should be answered."""
        if self.ttft_s <= 0:
            return arrived + self.timeout_s
        return arrived + min(self.timeout_s, self.ttft_s + max(0, tokens - 1) * self.tpot_s)


class StepTimes:
    """Decode steps as the entry sees them: seconds between a sequence's tokens, against how
    many sequences were in flight; a least-squares line through them predicts the TPOT of a
    batch size."""

    def __init__(self) -> None:
        self._steps: deque[tuple[int, float]] = deque(maxlen=WINDOW)
        self._prefills: deque[float] = deque(maxlen=PREFILLS)
        self._line: tuple[float, float, float, float] | None = None  # mean n, mean t, slope, floor

    def step(self, in_flight: int, seconds: float) -> None:
        self._steps.append((max(1, in_flight), seconds))
        self._line = None

    def prefill(self, seconds: float) -> None:
        self._prefills.append(seconds)

    @property
    def prefill_s(self) -> float:
        return statistics.median(self._prefills) if self._prefills else 0.0

    def _fit(self) -> tuple[float, float, float, float]:
        if self._line is None:
            ns, ts = zip(*self._steps)
            mean_n = statistics.fmean(ns)
            spread = sum((n - mean_n) ** 2 for n in ns)
            if spread == 0:  # one batch size seen so far: its median, no slope to tell
                self._line = (mean_n, statistics.median(ts), 0.0, 0.0)
            else:
                mean_t = statistics.fmean(ts)
                slope = sum((n - mean_n) * (t - mean_t) for n, t in self._steps) / spread
                # More sequences never make a step faster; no batch is faster than the fastest step seen.
                self._line = (mean_n, mean_t, max(0.0, slope), min(ts))
        return self._line

    def tpot(self, in_flight: int) -> float | None:
        """Predicted seconds per token with `in_flight` sequences; None before any step."""
        if not self._steps:
            return None
        mean_n, mean_t, slope, floor = self._fit()
        return max(floor, mean_t + slope * (in_flight - mean_n))

    def most_within(self, tpot_s: float, ceiling: int) -> int:
        """The most sequences in flight (1 to `ceiling`) whose predicted TPOT is within `tpot_s`,
        never more than twice the most seen: the line is not trusted far past what it was fitted
        to, so a bound grows as TCP's window does in slow start, measuring each size it lets in."""
        mean_n, mean_t, slope, _ = self._fit()
        ceiling = min(ceiling, 2 * max(n for n, _ in self._steps))
        if slope == 0:
            return ceiling if mean_t <= tpot_s else 1
        return max(1, min(ceiling, math.floor(mean_n + (tpot_s - mean_t) / slope)))


def batch_bound(steps: StepTimes, tpot_objective_s: float) -> int:
    """The most sequences in flight whose predicted TPOT meets the objective: unbounded (MAX_BOUND)
    without an objective; one until a step is measured; at least one."""
    if tpot_objective_s <= 0:
        return MAX_BOUND
    if steps.tpot(1) is None:
        return 1
    return steps.most_within(tpot_objective_s, MAX_BOUND)


def predicted_start(now: float, bound: int, running_left_s: list[float], ahead_s: list[float]) -> float:
    """When a request queued behind `ahead_s` (the predicted service of each request before it,
    in order) gets one of `bound` places, with `running_left_s` the time left to each sequence
    in flight. Places free as the running finish; each request ahead takes the first free."""
    free = sorted(now + max(0.0, left) for left in running_left_s)[:bound]
    free += [now] * (bound - len(free))
    heapq.heapify(free)
    for service in ahead_s:
        heapq.heappush(free, heapq.heappop(free) + service)
    return free[0]


@dataclass(frozen=True)
class Decision:
    admit: bool
    start_s: float       # predicted time the request gets its place
    completion_s: float  # predicted time it is answered
    retry_after_s: float = 0.0


def decide(now: float, deadline: float, tokens: int, bound: int, steps: StepTimes,
           running_left_s: list[float], ahead_s: list[float]) -> Decision:
    """Admit a request of `tokens` new tokens (to wait its turn) or refuse it, by its predicted
    completion against its deadline. Before anything is measured, admit: no prediction, no refusal.
    (Asked only of models with a TTFT objective: GenerationGate.enter.)"""
    tpot = steps.tpot(min(bound, len(running_left_s) + len(ahead_s) + 1))
    if tpot is None:
        return Decision(True, now, now)
    start = predicted_start(now, bound, running_left_s, ahead_s)
    completion = start + steps.prefill_s + max(0, tokens - 1) * tpot
    if completion <= deadline:
        return Decision(True, start, completion)
    return Decision(False, start, completion, max(1.0, start - now))
