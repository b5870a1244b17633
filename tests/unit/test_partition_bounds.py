"""Stage boundaries: uniform, balanced (as DeepSpeed balanced them), and impossible counts."""
from __future__ import annotations

import itertools

import pytest

from models.partition import balanced_bounds, stage_bounds, uniform_bounds


def test_uniform_bounds_put_embedding_first_and_head_last():
    assert uniform_bounds(32, 4) == [0, 8, 16, 23, 32]
    assert uniform_bounds(8, 1) == [0, 8]


# What DeepSpeed 0.19.8's `partition_balanced` returned for these, before models/partition.py
# took its place: a checkpoint partitioned before and after splits the same way.
DEEPSPEED = [
    ([28] + [3] * 30 + [28], 4, [0, 4, 16, 28, 32]),
    ([5, 1, 1, 1, 1, 1, 1, 5], 3, [0, 2, 7, 8]),
    ([10, 7, 7, 7, 7, 7, 7, 12], 4, [0, 2, 4, 6, 8]),
    ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 5, [0, 4, 6, 8, 9, 10]),
    ([4, 4, 4, 4], 4, [0, 1, 2, 3, 4]),
    ([9] + [2] * 22 + [9], 8, [0, 1, 5, 9, 13, 17, 20, 23, 24]),
    ([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9], 6, [0, 5, 7, 10, 12, 14, 15]),
]


@pytest.mark.parametrize("weights, stages, bounds", DEEPSPEED)
def test_balanced_bounds_are_deepspeeds(weights, stages, bounds):
    assert balanced_bounds(weights, stages) == bounds


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


