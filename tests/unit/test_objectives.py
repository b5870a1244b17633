"""Objective-aware admission (frontend/objectives.py, frontend/generation_gate.py): the TPOT line
and the batch bound it gives, earliest-deadline order, the predicted start behind those running
and queued, refusal only past the deadline, and places given back on every path."""
from __future__ import annotations

import asyncio

import pytest

from frontend.generation_gate import GenerationGate, Refused
from frontend.objectives import MAX_BOUND, Objectives, StepTimes, batch_bound, decide, predicted_start


def steps(*pairs: tuple[int, float]) -> StepTimes:
    s = StepTimes()
    for n, t in pairs:
        s.step(n, t)
    return s


def test_the_tpot_line_and_the_bound_it_gives():
    s = steps(*[(1, 0.05)] * 5, *[(8, 0.12)] * 5)      # 10 ms more per sequence
    assert s.tpot(1) == pytest.approx(0.05) and s.tpot(8) == pytest.approx(0.12)
    assert s.tpot(4) == pytest.approx(0.08)
    assert batch_bound(s, 0.10) == 6                    # 0.05 + 0.01 * 5 = 0.10
    assert batch_bound(s, 0.5) == 16                    # never more than twice the most measured
    assert batch_bound(steps((1, 0.05)), 0.1) == 2      # one size seen: double it, measure again
    assert batch_bound(s, 0.0) == MAX_BOUND             # no objective: no bound
    assert batch_bound(StepTimes(), 0.1) == 1           # nothing measured yet: one, to measure
    assert batch_bound(steps((1, 0.2)), 0.1) == 1       # even one sequence misses it: one at a time
    assert steps((4, 0.2), (2, 0.3)).tpot(8) == pytest.approx(0.25)  # a falling line: flat, at the mean


def test_a_bursts_first_steps_do_not_hide_what_the_last_burst_took():
    """Each sequence's steps are averaged before the line is fitted, so a new burst's first steps
    (waiting for its prefills) weigh one step per sequence against what whole sequences took."""
    s = StepTimes()
    for i in range(32):                                 # a burst of 32, each 16 tokens: 0.17 s a token
        for t in [0.5] + [0.15] * 15:
            s.step(32, t, ("first", i))
    for i in range(16):                                 # quiet: one at a time
        for _ in range(16):
            s.step(1, 0.05, ("quiet", i))
    for i in range(32):                                 # the next burst's first steps
        s.step(32, 0.5, ("next", i))
    # The 64 latest sequences: 32 of the new burst (1 step each), 16 quiet, 16 of the first burst.
    whole = (16 * 16 * (0.5 + 15 * 0.15) / 16 + 32 * 0.5) / (16 * 16 + 32)
    assert s.tpot(32) == pytest.approx(whole)           # about 0.21 s; the burst's steps alone: 0.5 s
    assert s.tpot(1) == pytest.approx(0.05, abs=0.01)


def test_deadlines_from_objectives_or_the_timeout():
    assert Objectives(2.0, 0.2, 120).deadline(100.0, 16) == pytest.approx(100 + 2 + 15 * 0.2)
    assert Objectives(0.0, 0.2, 120).deadline(100.0, 16) == 220.0
    assert Objectives(60.0, 10.0, 120).deadline(100.0, 16) == 220.0  # never past the timeout


def test_the_predicted_start_behind_the_running_and_the_queued():
    assert predicted_start(0.0, 2, [], []) == 0.0
    assert predicted_start(0.0, 2, [3.0, 1.0], []) == 1.0
    assert predicted_start(0.0, 2, [3.0, 1.0], [5.0]) == 3.0   # the one ahead takes the place free at 1
    assert predicted_start(0.0, 1, [3.0, 1.0], []) == 1.0      # over the bound: the first to finish frees it


def test_refused_only_when_predicted_past_the_deadline():
    s = steps(*[(1, 0.1)] * 4)
    s.prefill(0.5)
    fits = decide(0.0, 2.1, 16, 1, s, [], [])
    assert fits.admit and fits.completion_s == pytest.approx(0.5 + 15 * 0.1)
    late = decide(0.0, 2.1, 16, 1, s, [4.0], [])
    assert not late.admit and late.start_s == 4.0 and late.retry_after_s == pytest.approx(4.0)
    assert decide(0.0, 0.001, 16, 1, StepTimes(), [9.0], []).admit   # nothing measured: no refusal


def test_predictions_corrected_by_how_far_they_were_off():
    s = steps(*[(1, 0.2)] * 4)
    assert not decide(0.0, 2.0, 16, 1, s, [], []).admit    # 15 tokens at 0.2 s: 3 s, past 2
    for took in [0.1] * 9 + [0.4] * 9:                       # sequences took half or twice the line's
        s.took(0.2, took)
    assert s.line(1) == pytest.approx(0.2)
    assert s.tpot(1) == pytest.approx(0.4)                   # the median: the line's bias taken out
    assert s.tpot(1, 0.1) == pytest.approx(0.1)              # the lowest tenth: hopeful
    assert batch_bound(s, 0.4) == 2 and batch_bound(s, 0.3) == 1  # bounded by the corrected TPOT
    assert decide(0.0, 2.0, 16, 1, s, [], []).admit          # hopefully 1.5 s: it waits its turn
    assert not decide(0.0, 1.0, 16, 1, s, [], []).admit      # not even then


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_places_are_given_in_deadline_order_and_back_on_every_path():
    async def scenario():
        clock = Clock()
        gate = GenerationGate(Objectives(10.0, 0.1, 120), clock)
        for _ in range(4):
            gate.steps.step(1, 0.2)                    # one sequence already misses 0.1: bound 1
        first = gate.enter(0.0, 8)
        await first.wait(1)
        late = gate.enter(0.0, 40)                     # deadline 10 + 39 * 0.1 = 13.9
        soon = gate.enter(0.0, 4)                      # deadline 10.3: ahead of `late`
        assert (soon.placed.done(), late.placed.done()) == (False, False)
        first.close()
        assert soon.placed.done() and not late.placed.done()
        with pytest.raises(TimeoutError):
            await late.wait(0.01)                       # gave up waiting: its place is not kept
        soon.close()
        assert gate.in_flight == 0 and not gate._queue
        clock.now = 50.0
        with pytest.raises(Refused):
            gate.enter(0.0, 8)                          # arrived long ago: cannot meet 10 + 0.7 s
        no_ttft = GenerationGate(Objectives(0.0, 0.1, 120), clock)
        no_ttft.steps.step(1, 0.2)
        no_ttft.enter(0.0, 8).close()                   # no TTFT objective: nothing is refused here
        wide = gate.enter(50.0, 4, weight=3)            # wider than the bound, alone: it runs
        await wide.wait(1)
        assert gate.in_flight == 3
        wide.close()
        wide.close()                                    # twice is harmless
        assert gate.in_flight == 0
    asyncio.run(scenario())


def test_tokens_time_the_steps_and_the_prefill():
    async def scenario():
        clock = Clock()
        gate = GenerationGate(Objectives(), clock)
        ticket = gate.enter(0.0, 3)
        await ticket.wait(1)
        clock.now = 0.4
        ticket.token()            # first token: the prefill
        ticket.token(choice=1)    # another choice's: not a step of its own
        clock.now = 0.5
        ticket.token()
        assert gate.steps.prefill_s == pytest.approx(0.4) and gate.steps.tpot(1) == pytest.approx(0.1)
        assert ticket.left == 1.0
        ticket.close()
        # A decode of three steps or more is compared, when it ends, with the TPOT predicted as it began.
        timed = gate.enter(0.5, 5)
        await timed.wait(1)
        for now in (0.9, 0.95, 1.0, 1.05):
            clock.now = now
            timed.token()
        timed.close()
        assert list(gate.steps._errors) == [pytest.approx(0.05 / 0.1)]
    asyncio.run(scenario())


def test_an_idle_entry_measures_afresh_what_it_would_refuse_for_good():
    """Steps measured slow (replicas still compiling) would refuse every request of 8 tokens even
    on an idle entry, and only what it admits is measured: idle for a refusal's Retry-After, it
    admits the next one and starts measuring again; not sooner, and not while busy."""
    async def scenario():
        clock = Clock()
        gate = GenerationGate(Objectives(2.0, 0.2, 120), clock)
        for _ in range(8):
            gate.steps.step(1, 0.5)
        with pytest.raises(Refused) as refused:
            gate.enter(0.0, 8)                          # idle since 0 s, for no time yet
        assert refused.value.decision.retry_after_s == 1.0
        clock.now = 0.9
        with pytest.raises(Refused):
            gate.enter(0.9, 8)                          # still within the Retry-After
        clock.now = 1.0
        probe = gate.enter(1.0, 8)                      # idle for 1 s: let in, measured afresh
        await probe.wait(1)
        assert gate.steps.tpot(1) is None
        probe.token()
        clock.now = 1.5
        probe.token()                                   # still 0.5 s a step
        with pytest.raises(Refused):
            gate.enter(1.5, 8)                          # busy: refused on what the probe measured
        probe.close()
        clock.now = 2.0
        with pytest.raises(Refused):
            gate.enter(2.0, 8)                          # idle again, for 0.5 s only
        clock.now = 2.5
        fast = gate.enter(2.5, 8)                       # idle for 1 s again: let in, measured afresh
        await fast.wait(1)
        for now in (2.6, 2.65, 2.7, 2.75):
            clock.now = now
            fast.token()
        fast.close()
        admitted = gate.enter(2.75, 8)                  # 0.05 s a step now: admitted on its merits
        assert gate.steps.tpot(1) == pytest.approx(0.05)
        admitted.close()
    asyncio.run(scenario())
