"""The PID corrector, table-driven like Knative's autoscaler tests: direction, anti-windup,
bounds, fast scale-up, scale-down hysteresis, key stages."""
from __future__ import annotations

import math

import pytest

from autoscaler.policy.corrector import (
    Corrector,
    CorrectorMemory,
    PIDConfig,
    PIDMemory,
    pid_step,
    stage_delay,
    stage_targets,
)
from autoscaler.policy.queueing import mmc_sojourn
from autoscaler.policy.state import PipelineState, StageState
from contracts.config import Bounds

CFG = PIDConfig()


@pytest.mark.parametrize("name,delay,target,replicas,mem,expect", [
    ("over target adds", 2.0, 1.0, 2, PIDMemory(), "up"),
    ("far over target adds several", 11.0, 1.0, 2, PIDMemory(), "up>1"),
    ("infinite delay adds", math.inf, 1.0, 2, PIDMemory(), "up>1"),
    ("on target holds", 1.0, 1.0, 3, PIDMemory(), "same"),
    ("under target holds before hysteresis", 0.2, 1.0, 3, PIDMemory(), "same"),
    ("under target long enough removes one", 0.2, 1.0, 3, PIDMemory(last_delay=0.2, below_ticks=4), "down1"),
    ("slightly under target never removes", 0.9, 1.0, 3, PIDMemory(last_delay=0.9, below_ticks=100), "same"),
    ("never below r_min", 0.1, 1.0, 1, PIDMemory(last_delay=0.1, below_ticks=100), "same"),
])
def test_pid_direction(name, delay, target, replicas, mem, expect):
    new, _, terms = pid_step(CFG, mem, delay, target, replicas)
    if expect == "up":
        assert new > replicas, terms
    elif expect == "up>1":
        assert new > replicas + 1, terms
    elif expect == "same":
        assert new == replicas, terms
    elif expect == "down1":
        assert new == replicas - 1, terms


def test_bounds_and_step_limits():
    cfg, bounds = PIDConfig(kp=100.0, max_up=4), Bounds(1, 10)
    new, _, _ = pid_step(cfg, PIDMemory(), math.inf, 1.0, 3, bounds)
    assert new == 7  # at most max_up per tick
    new, _, _ = pid_step(cfg, PIDMemory(), math.inf, 1.0, 9, bounds)
    assert new == 10  # never above r_max


def test_anti_windup_stops_the_integral_at_the_ceiling():
    cfg = PIDConfig(integral_limit=100.0)
    mem = PIDMemory()
    for _ in range(50):
        _, mem, _ = pid_step(cfg, mem, 5.0, 1.0, 4, Bounds(1, 4))  # pinned at r_max, error positive
    assert mem.integral == 0.0
    mem = PIDMemory()
    for _ in range(50):
        _, mem, _ = pid_step(PIDConfig(integral_limit=3.0), mem, 5.0, 1.0, 2)
    assert mem.integral == pytest.approx(3.0)  # clamped


def test_derivative_is_on_the_measurement():
    # The same delays against a changed target: no derivative kick from the target change.
    _, mem, _ = pid_step(CFG, PIDMemory(), 1.0, 1.0, 2)
    _, _, terms = pid_step(CFG, mem, 1.0, 0.5, 2)
    assert terms["d"] == 0.0
    _, _, rising = pid_step(CFG, PIDMemory(last_delay=1.0), 2.0, 1.0, 2)
    assert rising["d"] > 0


def stage(i, lam, s, r, q=0, cv=1.0):
    return StageState(stage=i, arrival_rate=lam, service_time_s=s, replicas=r, queue_length=q, arrival_cv=cv)


def test_targets_split_the_slo_by_service_time():
    state = PipelineState("m", (stage(0, 1, 0.1, 1), stage(1, 1, 0.3, 1)), slo_s=2.0, entry_rate=1)
    assert stage_targets(state) == pytest.approx([0.5, 1.5])


def test_stage_delay_is_the_mmc_sojourn_with_poisson_traffic():
    s = stage(0, 2.0, 1.0, 3)
    assert stage_delay(s) == pytest.approx(mmc_sojourn(2.0, 1.0, 3))
    assert stage_delay(stage(0, 2.0, 1.0, 3, cv=2.0)) > stage_delay(s)
    assert stage_delay(stage(0, 2.0, 1.0, 3, q=10)) > stage_delay(s)


def test_a_burst_makes_one_key_stage_and_only_it_scales():
    # Stage 1 is slow and congested; stages 0 and 2 are comfortable.
    state = PipelineState("m", (stage(0, 5, 0.02, 1), stage(1, 5, 0.5, 2, q=20), stage(2, 5, 0.02, 1)),
                          slo_s=3.0, entry_rate=5)
    decision, memory = Corrector().decide(state)
    assert decision.key_stages == (1,)
    assert decision.replicas()[1] >= 3  # at least stable at once: λ·s = 2.5
    assert decision.replicas()[0] == 1 and decision.replicas()[2] == 1
    reason = decision.stages[1].reason
    assert {"lambda", "mu", "predicted_delay_s", "target_s", "p", "i", "d"} <= set(reason)
    assert isinstance(memory, CorrectorMemory) and len(memory.stages) == 3


def test_surplus_is_removed_slowly_after_the_burst():
    state = PipelineState("m", (stage(0, 0.5, 0.1, 8),), slo_s=1.0, entry_rate=0.5)
    corrector, memory, replicas = Corrector(), None, []
    for _ in range(12):
        decision, memory = corrector.decide(state, memory)
        replicas.append(decision.replicas()[0])
        state = PipelineState("m", (stage(0, 0.5, 0.1, replicas[-1]),), slo_s=1.0, entry_rate=0.5)
    assert replicas[:4] == [8, 8, 8, 8]               # hysteresis: nothing for down_ticks - 1 ticks
    assert all(a - b <= 1 for a, b in zip(replicas, replicas[1:]))  # one at a time
    assert replicas[-1] < 8


def test_a_stage_with_no_service_time_yet_gets_an_even_share():
    state = PipelineState("m", (stage(0, 0, 0.0, 1), stage(1, 1, 0.3, 1)), slo_s=2.0, entry_rate=0)
    assert stage_targets(state) == [1.0, 1.0]
    decision, _ = Corrector().decide(state)
    assert decision.replicas() == [1, 1]
