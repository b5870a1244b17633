"""The quart-flow variant's burst sizing, and what a window tells every policy: the traffic envelope
(which it and InferLine read) and the busy fraction."""
from __future__ import annotations

import numpy as np
import pytest

from autoscaler.policy.backlog_flow import BacklogFlow
from autoscaler.policy.state import Decision, PipelineState, StageDecision, StageState
from autoscaler.policy.window import Window, peak_count, stage_state


def pipeline(queues: list[int], now: float = 0.0) -> PipelineState:
    stages = tuple(StageState(stage=i, arrival_rate=2.0, service_time_s=0.1, replicas=1, queue_length=q)
                   for i, q in enumerate(queues))
    return PipelineState("m", stages, slo_s=2.0, entry_rate=2.0, now=now)


def one_each(state: PipelineState) -> Decision:
    return Decision("m", "quart", tuple(StageDecision(s.stage, 1, 1.0) for s in state.stages))


def test_a_backlog_sizes_its_stage_and_every_stage_after_it():
    # 27 queued at stage 1, drained within 1 s at 90 %: ceil(27 * 0.1 / 0.9) = 3 from stage 1 on.
    state = pipeline([0, 27, 0, 0])
    d, _ = BacklogFlow(horizon_s=1.0, target_utilization=0.9).apply(state, one_each(state))
    assert d.replicas() == [1, 3, 3, 3]
    assert [s.key for s in d.stages] == [False, True, True, True]
    assert d.stages[3].reason["backlog_upstream"] == 27


def test_a_bursts_size_is_held_then_let_go():
    flow = BacklogFlow(horizon_s=1.0, target_utilization=0.9, hold_s=30.0)
    burst = pipeline([27, 0], now=0.0)
    _, memory = flow.apply(burst, one_each(burst))
    calm = pipeline([0, 0], now=20.0)
    d, memory = flow.apply(calm, one_each(calm), memory)
    assert d.replicas() == [3, 3]
    later = pipeline([0, 0], now=31.0)
    d, _ = flow.apply(later, one_each(later), memory)
    assert d.replicas() == [1, 1]


def test_headroom_while_the_entry_is_calm_and_the_target_in_a_burst():
    # 6 req/s of 0.1 s: ceil(0.6 / 0.9) = 1 replica at the target, ceil(0.6 / 0.5) = 2 calm.
    flow = BacklogFlow(target_utilization=0.9, calm_utilization=0.5, calm_cv=4.0)

    def at(cv: float) -> PipelineState:
        return PipelineState("m", (StageState(stage=0, arrival_rate=6.0, service_time_s=0.1, replicas=1, arrival_cv=cv),),
                             slo_s=2.0, entry_rate=6.0)
    assert flow.apply(at(1.0), one_each(at(1.0)))[0].replicas() == [2]
    assert flow.apply(at(6.0), one_each(at(6.0)))[0].replicas() == [1]
    assert BacklogFlow().apply(at(1.0), one_each(at(1.0)))[0].replicas() == [1]  # no headroom unless asked
    with pytest.raises(ValueError, match="calm_utilization"):
        BacklogFlow(calm_utilization=0.0)


def test_the_envelope_is_the_busiest_second_of_the_window():
    times = [0.0, 5.0, 5.2, 5.4, 5.9, 9.0]
    assert peak_count(times) == 4 and peak_count([]) == 0
    s = stage_state(0, 10.0, Window.of(np.array(times), np.array([]), np.array([])), 0.1, 1, [1.0], 0, 0)
    assert s.peak_rate == 4.0 and s.arrival_rate == 0.6


def test_the_busy_fraction_is_service_time_over_the_window_and_replicas():
    done = Window.of(np.array([1.0, 2.0]), np.array([0.5] * 8), np.array([0.0] * 8))
    # 8 items of 0.5 s in 10 s on 2 ready replicas: 4 s of 20.
    assert stage_state(0, 10.0, done, 0.5, 2, [1.0, 1.0], 0, 0).busy_fraction == pytest.approx(0.2)
