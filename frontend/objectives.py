"""Objective-aware admission of generations at a model's entry (pure: state in, decision out).

A model may have a TTFT and a TPOT objective (QUART_TTFT_OBJECTIVE_S, QUART_TPOT_OBJECTIVE_S, set
per entry function in the stack). Continuous batching spreads every decode step over all the
sequences in flight, so a burst let in at once makes every request late. The entry therefore:

- bounds the sequences in flight to the most whose time per output token, as measured here
  (a line fitted to recent sequences' steps against the number in flight, its bias taken out),
  stays within the TPOT objective,
  starting from one and at most doubling past the most it has measured;
- queues the rest in earliest-deadline order (a request's deadline: its arrival plus the TTFT
  objective plus its tokens at the TPOT objective, within the request timeout);
- with a TTFT objective, refuses (429) only a request whose predicted completion (its wait for a
  place, its prefill, its tokens at the bounded batch's TPOT) is past its deadline even at a
  hopeful TPOT (from how far the predictions were off for recent sequences): what can still
  meet it waits.

Without objectives nothing is bounded or refused here: a request waits up to the request timeout
(vLLM's and OpenFaaS's behaviour), and only the stages' KV budgets refuse."""
from __future__ import annotations

import heapq
import math
import statistics
from collections import OrderedDict, deque
from collections.abc import Hashable
from dataclasses import dataclass

SEQUENCES = 64      # recent sequences the TPOT line is fitted to
PREFILLS = 32       # recent prefills whose median is "a prefill"
ERRORS = 64         # recent sequences whose TPOT is compared with what was predicted for them
HOPEFUL = 0.1       # the quantile of those a refusal is predicted at
MAX_BOUND = 256     # sequences in flight at most, with a TPOT objective
RETRY_AFTER_S = 1.0  # the least Retry-After of a refusal: an idle entry's


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
    many sequences were in flight. Each sequence's steps are averaged first (its TPOT so far, at
    the mean number in flight over them), and a least-squares line through the recent sequences,
    each weighted by its steps, predicts the TPOT of a batch size. Averaged per sequence because
    a request's completion is its tokens at its mean TPOT, and because the steps just after a
    burst enters wait for its prefills: a window of single steps then holds little else. On the
    bursts benchmark's trace at 4 requests/s, CV 4, single steps predicted 0.20-0.24 s a token
    where the next 3 s took 0.15 s, and refused 20 requests the plain pipeline answered in time;
    averaged per sequence, 0.16 s."""

    def __init__(self) -> None:
        # sequence -> [steps, sum of in flight, sum of seconds], least recently stepped first
        self._sequences: OrderedDict[Hashable, list[float]] = OrderedDict()
        self._prefills: deque[float] = deque(maxlen=PREFILLS)
        self._errors: deque[float] = deque(maxlen=ERRORS)  # what a sequence took over what was predicted
        self._line: tuple[float, float, float, float] | None = None  # mean n, mean t, slope, floor

    def step(self, in_flight: int, seconds: float, sequence: Hashable | None = None) -> None:
        """One step of `sequence` (a step of its own sequence where None)."""
        key = object() if sequence is None else sequence
        sums = self._sequences.pop(key, None) or [0, 0.0, 0.0]
        sums[0] += 1
        sums[1] += max(1, in_flight)
        sums[2] += seconds
        self._sequences[key] = sums
        if len(self._sequences) > SEQUENCES:
            self._sequences.popitem(last=False)
        self._line = None

    def prefill(self, seconds: float) -> None:
        self._prefills.append(seconds)

    @property
    def prefill_s(self) -> float:
        return statistics.median(self._prefills) if self._prefills else 0.0

    def took(self, predicted_s: float, seconds: float) -> None:
        """A sequence the line predicted `predicted_s` a token for as its decode began took `seconds`."""
        self._errors.append(seconds / predicted_s)

    def _error(self, quantile: float) -> float:
        """The `quantile` of recent sequences' TPOT over the line's prediction for them; 1 until ten are known."""
        if len(self._errors) < 10:
            return 1.0
        return sorted(self._errors)[int(quantile * len(self._errors))]

    def _fit(self) -> tuple[float, float, float, float]:
        if self._line is None:
            points = [(w, n / w, t / w) for w, n, t in self._sequences.values()]
            weight = sum(w for w, _, _ in points)
            mean_n = sum(w * n for w, n, _ in points) / weight
            mean_t = sum(w * t for w, _, t in points) / weight
            spread = sum(w * (n - mean_n) ** 2 for w, n, _ in points)
            slope = sum(w * (n - mean_n) * (t - mean_t) for w, n, t in points) / spread if spread else 0.0
            # More sequences never make a step faster; no batch is faster than the fastest sequence seen.
            self._line = (mean_n, mean_t, max(0.0, slope), min(t for _, _, t in points))
        return self._line

    def most_seen(self) -> int:
        """The most sequences in flight a recent sequence's steps averaged."""
        return math.ceil(max(n / w for w, n, _ in self._sequences.values()))

    def line(self, in_flight: int) -> float | None:
        """The line's seconds per token with `in_flight` sequences; None before any step."""
        if not self._sequences:
            return None
        mean_n, mean_t, slope, floor = self._fit()
        return max(floor, mean_t + slope * (in_flight - mean_n))

    def tpot(self, in_flight: int, quantile: float = 0.5) -> float | None:
        """Predicted seconds per token with `in_flight` sequences: the line's, times the `quantile`
        of what recent sequences took over what it predicted for them as they began (the median:
        the line's bias taken out; a low quantile: a hopeful prediction); None before any step."""
        line = self.line(in_flight)
        return None if line is None else line * self._error(quantile)

    def most_within(self, tpot_s: float, ceiling: int) -> int:
        """The most sequences in flight (1 to `ceiling`) whose predicted TPOT is within `tpot_s`,
        never more than twice the most seen: the line is not trusted far past what it was fitted
        to, so a bound grows as TCP's window does in slow start, measuring each size it lets in."""
        mean_n, mean_t, slope, _ = self._fit()
        ceiling, tpot_s = min(ceiling, 2 * self.most_seen()), tpot_s / self._error(0.5)
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
    completion against its deadline, at the hopeful TPOT (the HOPEFUL quantile; `running_left_s`
    and `ahead_s` are hopeful too): a refusal is final where a wait is not. Before anything is
    measured, admit: no prediction, no refusal. (Asked only of models with a TTFT objective:
    GenerationGate.enter.)"""
    tpot = steps.tpot(min(bound, len(running_left_s) + len(ahead_s) + 1), HOPEFUL)
    if tpot is None:
        return Decision(True, now, now)
    start = predicted_start(now, bound, running_left_s, ahead_s)
    completion = start + steps.prefill_s + max(0, tokens - 1) * tpot
    if completion <= deadline:
        return Decision(True, start, completion)
    return Decision(False, start, completion, max(RETRY_AFTER_S, start - now))
