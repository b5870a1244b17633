"""The smoother (CV attention, Eq. 7) and the CPU compensator, and QUART composed of them."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from autoscaler.policy.compensator import Compensator, CPUFit, fit_cpu_profile, load_fits, save_fits, sojourn
from autoscaler.policy.corrector import stage_targets
from autoscaler.policy.quart import Quart
from autoscaler.policy.smoother import CVAttention, Smoother, beta, predecessors
from autoscaler.policy.state import Decision, PipelineState, StageDecision, StageState
from contracts.config import Bounds
from tools.cv_traces import synthetic
from tools.train_smoother import evaluate, split, train


def st(i, lam, s, r, cv=1.0, q=0):
    return StageState(stage=i, arrival_rate=lam, service_time_s=s, replicas=r, arrival_cv=cv, queue_length=q)


def proposed(state: PipelineState, replicas: list[int], key: tuple[int, ...] = ()) -> Decision:
    return Decision(state.model, "test", tuple(StageDecision(s.stage, r, 1.0, s.stage in key)
                                               for s, r in zip(state.stages, replicas)))


def test_gamma_gaps_reach_their_rate_and_cv():
    import numpy as np

    from loadgen.arrivals import gamma_gaps
    gaps = gamma_gaps(np.random.default_rng(1), rate=50.0, cv=4.0, n=20000)
    assert 1 / gaps.mean() == pytest.approx(50.0, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(4.0, rel=0.05)


def test_smoother_never_adds_and_never_goes_below_r_min():
    state = PipelineState("m", tuple(st(i, 2.0, 0.1, 1) for i in range(4)), slo_s=2.0, entry_rate=2.0)
    d = Smoother().smooth(replace(state, bounds=Bounds(2, 16)), proposed(state, [1, 5, 9, 3]))
    assert all(r <= p or r == 2 for r, p in zip(d.replicas(), [1, 5, 9, 3]))
    assert all(r >= 1 for r in d.replicas())
    assert d.replicas()[2] < 9  # surplus reclaimed
    d = Smoother().smooth(replace(state, bounds=Bounds(3, 16)), proposed(state, [8, 8, 8, 8]))
    assert min(d.replicas()) >= 3


def test_smoother_keeps_key_stages_and_stability():
    state = PipelineState("m", (st(0, 10.0, 0.05, 2), st(1, 10.0, 0.35, 6, q=30), st(2, 10.0, 0.05, 4)),
                          slo_s=2.0, entry_rate=10.0)
    d = Smoother().smooth(state, proposed(state, [2, 6, 4], key=(1,)))
    assert d.replicas()[1] == 6                 # the key stage is left alone
    assert d.replicas()[2] >= math.floor(10 * 0.05) + 1


def test_bursty_stages_keep_more_of_their_own_need():
    assert beta(4.0) > beta(1.0) > beta(0.1)
    smooth = PipelineState("m", (st(0, 8.0, 0.1, 1, cv=0.1), st(1, 8.0, 0.3, 1, cv=0.1)), slo_s=1.0, entry_rate=8)
    bursty = PipelineState("m", (st(0, 8.0, 0.1, 1, cv=4.0), st(1, 8.0, 0.3, 1, cv=4.0)), slo_s=1.0, entry_rate=8)
    a = Smoother().smooth(smooth, proposed(smooth, [20, 20])).replicas()
    b = Smoother().smooth(bursty, proposed(bursty, [20, 20])).replicas()
    # The same stages and load, only the CV differs: burstier traffic keeps strictly more.
    assert all(x >= y for x, y in zip(b, a)) and sum(b) > sum(a), (a, b)


def test_attention_model_beats_the_naive_baseline_held_out(tmp_path):
    samples = synthetic(160, seed=3)
    fit, held = split(samples, seed=3)
    model = train(fit, epochs=8, seed=3)
    result = evaluate(model, held)
    assert sum(result["model_mae"][1:]) < 0.6 * sum(result["naive_mae"][1:])
    model.save(tmp_path / "cv.pt")
    again = CVAttention.load(tmp_path / "cv.pt")
    x = torch.rand(4, 5)
    mask = predecessors(4, ((0, 1), (1, 2), (2, 3)))
    assert torch.equal(again(x, mask), model(x, mask))
    assert again(x, mask)[0] == x[0, 0]  # the entry stage keeps its observed CV


def test_cpu_fit_recovers_a_known_profile(tmp_path):
    truth = CPUFit(0.01, 0.2, 0.001)
    samples = [(c, p, truth.predict(c, p)) for c in (1, 2, 4, 8) for p in (16, 64, 256)]
    fit = fit_cpu_profile(samples)
    assert fit.b0 == pytest.approx(0.01, abs=1e-9) and fit.b1 == pytest.approx(0.2) and fit.b2 == pytest.approx(0.001)
    save_fits({3: fit}, tmp_path / "fits.json")
    assert load_fits(tmp_path / "fits.json") == {3: fit}


def test_compensator_choice_meets_the_target_on_its_own_fit():
    fit = CPUFit(0.005, 0.3, 0.0)
    stage = StageState(stage=0, arrival_rate=4.0, service_time_s=0.305, replicas=3)
    state = PipelineState("m", (stage,), slo_s=0.5, entry_rate=4.0)
    d = Compensator({0: fit}, cpu_max=8).allocate(state, proposed(state, [2]))  # one reclaimed
    cpus, target = int(d.stages[0].cpus), stage_targets(state)[0]
    assert sojourn(stage, fit.predict(cpus, 0), 2) <= target
    assert cpus == 1 or sojourn(stage, fit.predict(cpus - 1, 0), 2) > target  # the fewest
    assert d.stages[0].reason["cpu_target_met"]


def test_compensator_hands_back_replicas_when_cpus_are_not_enough():
    fit = CPUFit(0.2, 0.1, 0.0)  # a floor of 0.2 s that no CPU count removes
    stage = StageState(stage=0, arrival_rate=20.0, service_time_s=0.3, replicas=3)
    state = PipelineState("m", (stage,), slo_s=0.35, entry_rate=20.0)
    d = Compensator({0: fit}, cpu_max=4).allocate(state, proposed(state, [2]))
    assert d.stages[0].cpus == 4 and d.replicas()[0] > 2


def test_compensator_never_scales_up_past_what_the_stage_had():
    # The service time alone (0.4 s at CPU_max) misses the 0.3 s target: no replica count helps,
    # so the stage keeps the 2 replicas it had; before, it got r_max (a jump 2 -> 64).
    fit = CPUFit(0.4, 0.1, 0.0)
    stage = StageState(stage=0, arrival_rate=5.0, service_time_s=0.5, replicas=2)
    state = PipelineState("m", (stage,), slo_s=0.3, entry_rate=5.0, bounds=Bounds(1, 64))
    d = Compensator({0: fit}, cpu_max=4).allocate(state, proposed(state, [1]))
    assert d.replicas() == [2] and d.stages[0].cpus == 4 and not d.stages[0].reason["cpu_target_met"]


def test_compensator_leaves_stages_that_kept_their_replicas():
    stage = StageState(stage=0, arrival_rate=4.0, service_time_s=0.3, replicas=2, cpus=1.0)
    state = PipelineState("m", (stage,), slo_s=0.5, entry_rate=4.0)
    d = Compensator({0: CPUFit(0.0, 0.3, 0.0)}).allocate(state, proposed(state, [2]))
    assert d.stages[0] == proposed(state, [2]).stages[0]


def test_quart_policy_runs_corrector_smoother_compensator():
    state = PipelineState("m", (st(0, 5, 0.02, 4), st(1, 5, 0.5, 2, q=20), st(2, 5, 0.02, 4)),
                          slo_s=3.0, entry_rate=5)
    policy = Quart(compensator=Compensator({0: CPUFit(0.0, 0.02, 0.0)}))
    d, memory = policy.decide(state)
    assert d.policy == "quart" and d.key_stages == (1,)
    assert d.replicas()[1] >= 3                        # scaled up at once
    assert d.replicas()[0] == 4 and d.replicas()[2] == 4  # nothing reclaimed right after a burst
    for _ in range(policy.corrector.config.down_ticks - 1):
        d, memory = policy.decide(state, memory)
    assert d.replicas()[0] < 4 and d.replicas()[2] < 4    # reclaimed once the stages settled
    assert "cpus" in d.stages[0].reason and "predicted_cv" in d.stages[2].reason




def test_cpu_fit_with_a_payload_dependent_parallel_part():
    truth = CPUFit(0.004, 0.005, 3e-5, 3e-4)
    samples = [(c, p, truth.predict(c, p)) for c in (1, 2, 4) for p in (16, 64, 256)]
    fit = fit_cpu_profile(samples)
    assert all(fit.predict(c, p) == pytest.approx(s, rel=1e-6) for c, p, s in samples)


def test_pinned_replicas_get_cores_of_their_own_while_there_are_free_ones():
    from engine.cpu_sets import pick_cores
    host = [0, 1, 2, 3]
    assert pick_cores(host, [], 2) == [0, 1]
    assert pick_cores(host, [[0, 1]], 2) == [2, 3]
    assert pick_cores(host, [[0, 1], [2]], 1) == [3]
    # None free: the least shared.
    assert pick_cores(host, [[0, 1], [2, 3], [0]], 1) == [1]
    assert pick_cores(host, [], 9) == [0, 1, 2, 3] and pick_cores(host, [], 0) == [0]


def test_r_total_takes_back_the_largest_cpu_raises_first():
    from autoscaler.policy.compensator import within_total
    state = PipelineState("m", (st(0, 1, 0.1, 2), st(1, 1, 0.1, 1)), slo_s=1.0, entry_rate=1.0)
    decision = Decision("m", "quart", (StageDecision(0, 2, 4.0), StageDecision(1, 1, 2.0)))
    # 2 x 4 + 1 x 2 = 10 CPUs asked, at most 7: stage 0, the most per replica, gives back one CPU at
    # a time (10 -> 8 -> 6).
    (bounded,) = within_total([state], [decision], 7)
    assert sum(d.replicas * d.cpus for d in bounded.stages) <= 7
    assert [d.cpus for d in bounded.stages] == [2.0, 2.0] and bounded.stages[0].reason["cpu_total_bound"] == 2.0
    # Replica counts alone over the bound: nothing more to take back, nothing below one CPU.
    (floor,) = within_total([state], [decision], 1)
    assert [d.cpus for d in floor.stages] == [1.0, 1.0] and [d.replicas for d in floor.stages] == [2, 1]
