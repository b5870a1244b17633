"""Stage boundaries: uniform, DeepSpeed-balanced, and impossible counts."""
from __future__ import annotations

import itertools

import pytest

from models.partition import balanced_bounds, stage_bounds, uniform_bounds


def test_uniform_bounds_put_embedding_first_and_head_last():
    assert uniform_bounds(32, 4) == [0, 8, 16, 23, 32]
    assert uniform_bounds(8, 1) == [0, 8]


def test_balanced_bounds_follow_deepspeed():
    # A heavy embedding and head make the outer stages hold fewer blocks.
    weights = [28] + [3] * 30 + [28]
    bounds = balanced_bounds(weights, 4)
    assert bounds[0] == 0 and bounds[-1] == 32 and len(bounds) == 5
    heaviest = max(sum(weights[a:b]) for a, b in zip(bounds, bounds[1:]))
    # As balanced as contiguous stages can be: no 4-way split has a lighter heaviest stage.
    best = min(max(sum(weights[:i]), sum(weights[i:j]), sum(weights[j:k]), sum(weights[k:]))
               for i, j, k in itertools.combinations(range(1, 32), 3))
    assert heaviest == best


@pytest.mark.parametrize("stages", [0, 40])
def test_impossible_stage_counts_are_refused(stages):
    with pytest.raises(ValueError):
        stage_bounds([1] * 32, stages, "balanced")


