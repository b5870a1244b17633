"""The layout rule (autoscaler/policy/layout.py): HydraServe's sliding-window peak decides when a
pipelined model consolidates into whole-model replicas and when it splits back."""
from __future__ import annotations

from autoscaler.policy.layout import CONSOLIDATING, PIPELINED, SPLITTING, WHOLE, LayoutRule, LayoutState, decide, needed

RULE = LayoutRule(windows=3, per_replica=8, max_whole=1)


def state(layout: str, counts=(2, 3, 1), current: int = 0, busy: int = 1, whole_desired: int = 0,
          whole_live: int = 0, stages_live=(1, 1, 1, 1)) -> LayoutState:
    return LayoutState(layout, tuple(counts), current, busy, whole_desired, whole_live, tuple(stages_live))


def test_the_need_is_the_window_peak_on_top_of_what_the_model_holds():
    assert needed(state(PIPELINED, counts=(2, 7, 1), busy=1), RULE) == 1     # 1 + 7 = 8 fits one
    assert needed(state(PIPELINED, counts=(2, 7, 1), busy=2), RULE) == 2
    assert needed(state(PIPELINED, counts=(9, 0, 0, 0), busy=0), RULE) == 1  # older than the windows
    assert needed(state(PIPELINED, counts=(), current=17, busy=0), RULE) == 3
    assert needed(state(PIPELINED, counts=(), busy=0), RULE) == 1


def test_a_warm_quiet_pipeline_consolidates_once_its_whole_replica_serves():
    assert decide(state(PIPELINED, counts=(2, 3)), RULE) is None  # not warm for 3 windows yet
    go = decide(state(PIPELINED), RULE)
    assert (go.layout, go.whole, go.stages) == (CONSOLIDATING, 1, None)
    assert decide(state(CONSOLIDATING, whole_desired=1, whole_live=0), RULE) is None  # still starting
    done = decide(state(CONSOLIDATING, whole_desired=1, whole_live=1), RULE)
    assert (done.layout, done.whole, done.stages) == (WHOLE, None, 0)
    assert decide(state(WHOLE, whole_desired=1, whole_live=1, stages_live=(0, 0, 0, 0)), RULE) is None


def test_a_burst_splits_the_model_and_the_whole_replicas_go_once_the_stages_serve():
    burst = state(WHOLE, current=12, whole_desired=1, whole_live=1, stages_live=(0, 0, 0, 0))
    split = decide(burst, RULE)
    assert (split.layout, split.whole, split.stages) == (SPLITTING, None, 1)
    assert decide(state(SPLITTING, current=12, whole_desired=1, stages_live=(1, 0, 1, 1)), RULE) is None
    back = decide(state(SPLITTING, current=12, whole_desired=1, stages_live=(1, 1, 1, 1)), RULE)
    assert (back.layout, back.whole) == (PIPELINED, 0)
    # The burst stays in the windows: no consolidating again until it has aged out.
    assert decide(state(PIPELINED, counts=(12, 1, 1)), RULE) is None


def test_a_burst_while_consolidating_keeps_the_pipeline_and_whole_replicas_follow_the_need():
    abort = decide(state(CONSOLIDATING, current=20, whole_desired=1), RULE)
    assert (abort.layout, abort.whole) == (PIPELINED, 0)
    stray = decide(state(PIPELINED, whole_desired=1, counts=(20, 20, 20)), RULE)
    assert (stray.layout, stray.whole) == (PIPELINED, 0)
    wide = LayoutRule(windows=3, per_replica=8, max_whole=3)
    grow = decide(state(WHOLE, counts=(9, 3, 1), whole_desired=1, whole_live=1), wide)
    assert (grow.layout, grow.whole) == (WHOLE, 2)
