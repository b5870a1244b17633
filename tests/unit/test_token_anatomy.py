"""The token anatomy benchmark's arithmetic: a token's period at stage 0 is each stage's time from
arrival to hand-on plus the way back to stage 0, and each stage's time splits into its step and the rest."""
from __future__ import annotations

import pytest

from benchmarks.token_anatomy import anatomy
from state.records import StageSample

STEPS = (2.0, 6.0, 6.0, 4.0)     # ms a stage's step takes
AROUND = (1.0, 2.0, 1.0, 3.0)    # ms a stage spends around it (whole: record IDs count milliseconds)
ENTRY = 2.0                      # ms from the last stage's hand-on to the next step's arrival


def _token(k: int, start_ms: float) -> tuple[list[StageSample], float]:
    """One decode step's records at the four stages, each stage handing on as the next receives."""
    records, at = [], start_ms
    for i, (step, around) in enumerate(zip(STEPS, AROUND)):
        done = at + step + around
        records.append(StageSample(f"r.{k}", at / 1000.0, around / 2, step, f"s{i}", "decode", 1, int(done)))
        at = done
    return records, at + ENTRY


def test_the_period_is_the_stages_and_the_entry():
    steps, at = [], 1_000_000.0
    for k in range(5):
        records, at = _token(k, at)
        steps.append(records)
    parts = anatomy(steps)
    assert parts["decode steps"] == 5
    for i in range(4):
        assert parts[f"stage {i} step"] == STEPS[i]
        assert parts[f"stage {i} around the step"] == pytest.approx(AROUND[i])
    assert parts["back to stage 0"] == pytest.approx(ENTRY)
    assert parts["token period"] == pytest.approx(sum(STEPS) + sum(AROUND) + ENTRY)
