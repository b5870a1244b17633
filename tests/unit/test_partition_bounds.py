"""Stage boundaries: uniform, DeepSpeed-balanced, and impossible counts."""
from __future__ import annotations

import pytest

from pipeline.partition import balanced_bounds, stage_bounds, uniform_bounds


def test_uniform_bounds_put_embedding_first_and_head_last():
    assert uniform_bounds(32, 4) == [0, 8, 16, 23, 32]
    assert uniform_bounds(8, 1) == [0, 8]


def test_balanced_bounds_follow_deepspeed():
    # A heavy embedding and head make the outer stages hold fewer blocks.
    bounds = balanced_bounds([28] + [3] * 30 + [28], 4)
    assert bounds[0] == 0 and bounds[-1] == 32 and len(bounds) == 5
    sizes = [sum(([28] + [3] * 30 + [28])[a:b]) for a, b in zip(bounds, bounds[1:])]
    assert max(sizes) - min(sizes) <= 28


@pytest.mark.parametrize("stages", [0, 40])
def test_impossible_stage_counts_are_refused(stages):
    with pytest.raises(ValueError):
        stage_bounds([1] * 32, stages, "balanced")


