"""Each baseline against hand-worked cases."""
from __future__ import annotations

import math

import pytest

from autoscaler.policy.backlog_flow import BacklogFlow
from autoscaler.policy.baselines import BASELINES, KnativeKPA, OpenFaaSPro, RayServe, Static
from autoscaler.policy.paper_baselines import Cocktail, InferLine, INFless
from autoscaler.policy.state import PipelineState, StageState


def pipeline(*stages: StageState, rate: float = 10.0, now: float = 0.0) -> PipelineState:
    return PipelineState("m", stages, slo_s=2.0, entry_rate=rate, now=now)


def st(i=0, lam=10.0, s=0.1, r=1, q=0, inflight=0, peak=0.0) -> StageState:
    return StageState(stage=i, arrival_rate=lam, service_time_s=s, replicas=r, queue_length=q, in_flight=inflight,
                      peak_rate=peak)


def test_static_ignores_load():
    d, _ = Static(3).decide(pipeline(st(lam=1000, q=500), st(1)))
    assert d.replicas() == [3, 3]


def test_infless_sizes_each_stage_by_an_instances_max_rps_within_its_slo_share():
    # Two equal stages share a 2 s SLO: 1 s each. At 10 items/s an instance keeps its M/M/1
    # sojourn within 1 s up to 10 - 1 = 9 rps: 20 rps -> 3 instances, 5 rps -> 1.
    d, memory = INFless(keep_alive_s=60).decide(pipeline(st(0, lam=20), st(1, lam=5)))
    assert d.replicas() == [3, 1] and d.stages[0].reason["r_max"] == 9.0
    # Fewer are wanted: the surplus stays warm for the keep-alive, then goes.
    seen = []
    for t in (1, 30, 61):
        d, memory = INFless(keep_alive_s=60).decide(pipeline(st(0, lam=5, r=3), st(1, lam=5), now=t), memory)
        seen.append(d.replicas()[0])
    assert seen == [3, 3, 1]


def test_cocktail_provisions_ahead_of_a_rising_rate_and_never_below_the_current_one():
    policy, memory = Cocktail(horizon_s=5, target_utilization=1.0), None
    wants = []
    for t, rate in enumerate((10.0, 20.0, 30.0, 40.0)):
        d, memory = policy.decide(pipeline(st(lam=rate, r=1), now=t), memory)
        wants.append(d.replicas()[0])
    # Reactive alone would give ceil(rate * 0.1) = 1, 2, 3, 4; the forecast runs ahead of it.
    assert wants[0] == 1 and all(w > math.ceil(r * 0.1) for w, r in zip(wants[1:], (20, 30, 40)))
    assert memory[0].trend > 0
    # A falling forecast never takes a stage below what the load now needs.
    for t, rate in enumerate((40.0, 10.0, 10.0), start=4):
        d, memory = policy.decide(pipeline(st(lam=rate, r=1), now=t), memory)
    assert d.replicas()[0] >= 1


def test_inferline_plans_for_its_sample_and_tunes_to_the_traffic_envelope():
    policy = InferLine(plan_rps=10.0, plan_cv=1.0, downscale_delay_s=30)
    # The plan: 10 rps at 0.1 s with 1 s per stage needs 2 replicas (one would be at 100 %).
    d, memory = policy.decide(pipeline(st(0, lam=10), st(1, lam=10)))
    assert d.replicas() == [2, 2]
    # A burst of 50 in one second on a 10 rps window: sized for the envelope at once.
    d, memory = policy.decide(pipeline(st(0, lam=10, peak=50), st(1, lam=10), now=1), memory)
    assert d.replicas() == [5, 2] and d.stages[0].reason["envelope_rps"] == 50
    # Back to the plan only after the downscale delay.
    d, memory = policy.decide(pipeline(st(0, lam=10, r=5), st(1, lam=10, r=2), now=2), memory)
    assert d.replicas() == [5, 2]
    d, memory = policy.decide(pipeline(st(0, lam=10, r=5), st(1, lam=10, r=2), now=33), memory)
    assert d.replicas() == [2, 2]


def test_openfaas_pro_rps_formula_per_stage():
    # ceil(rps / (5 * 0.9)): 10 -> 3, 4 -> 1, 23 -> 6
    d, _ = OpenFaaSPro(target_rps=5.0).decide(pipeline(st(0, lam=10), st(1, lam=4), st(2, lam=23)))
    assert d.replicas() == [3, 1, 6]


def test_ray_serve_waits_for_the_upscale_delay():
    policy = RayServe(target_ongoing_requests=2, upscale_delay_s=3, downscale_delay_s=5)
    memory, seen = None, []
    for t in range(4):
        d, memory = policy.decide(pipeline(st(r=1, q=7, inflight=1), now=t), memory)
        seen.append(d.replicas()[0])
    assert seen == [1, 1, 4, 1]  # ceil(8 / 2) = 4 after 3 periods; the caller has not applied it yet
    memory, seen = None, []
    for t in range(6):
        d, memory = policy.decide(pipeline(st(r=4, q=0, inflight=1), now=t), memory)
        seen.append(d.replicas()[0])
    assert seen == [4, 4, 4, 4, 1, 4]


def test_knative_kpa_stable_mode_averages_the_window():
    kpa = KnativeKPA(target_concurrency=1.0, target_utilization=1.0)
    memory = None
    for t in range(10):
        d, memory = kpa.decide(pipeline(st(r=2, inflight=2), now=t), memory)
    assert d.replicas() == [2] and not d.stages[0].reason["panic"]


def test_knative_kpa_panics_at_double_and_never_scales_down_in_panic():
    kpa = KnativeKPA(target_concurrency=1.0, target_utilization=1.0, stable_window_s=60, panic_window_s=6)
    memory = None
    for t in range(10):
        d, memory = kpa.decide(pipeline(st(r=2, inflight=2), now=t), memory)
    # A burst: 10 in the stage on 2 replicas -> the 6 s window wants >= 4 = 200 % of 2: panic.
    d, memory = kpa.decide(pipeline(st(r=2, q=8, inflight=2), now=10), memory)
    assert d.stages[0].reason["panic"]
    up = d.replicas()[0]
    assert up >= 4
    # The burst is gone, but panic holds the count for a stable window.
    d, memory = kpa.decide(pipeline(st(r=up, inflight=0), now=20), memory)
    assert d.replicas()[0] == up and d.stages[0].reason["panic"]
    d, memory = kpa.decide(pipeline(st(r=up, inflight=0), now=71), memory)
    assert not d.stages[0].reason["panic"] and d.replicas()[0] < up


def test_knative_scale_down_rate_is_bounded():
    kpa = KnativeKPA(target_concurrency=1.0, target_utilization=1.0, max_scale_down_rate=2.0)
    d, _ = kpa.decide(pipeline(st(r=10, inflight=0), now=0))
    assert d.replicas() == [5]  # at most halved in one step


def test_every_baseline_runs_on_a_dag_and_keeps_stage_ids():
    state = PipelineState("m", (st(0), st(1), st(2)), slo_s=2.0, entry_rate=10, edges=((0, 1), (0, 2)))
    for policy in BASELINES.values():
        d, _ = policy.decide(state, None)
        assert [s.stage for s in d.stages] == [0, 1, 2] and all(r >= 1 for r in d.replicas())


def test_policies_come_from_one_configuration(tmp_path):
    from autoscaler.policy.controller import make_policy
    from contracts.config import load_settings
    config = tmp_path / "quart.yml"
    config.write_text("policy: knative-kpa\npolicy_params: '{\"target_concurrency\": 3.0}'\ntick_s: 2.0\n")
    settings = load_settings(environ={"QUART_CONFIG": str(config), "QUART_TICK_S": "0.5"})
    assert settings.autoscaler.tick_s == 0.5  # the environment overrides the file
    policy = make_policy(settings, "m")
    assert isinstance(policy, KnativeKPA) and policy.target_concurrency == 3.0
    quart = make_policy(load_settings(environ={"QUART_POLICY": "quart", "QUART_POLICY_PARAMS": '{"kp": 2.0}',
                                               "QUART_HOME": str(tmp_path)}), "llama-7b")
    assert quart.corrector.config.kp == 2.0 and quart.corrector.config.period_s == 1.0


def test_quart_flow_takes_its_sizing_and_the_pids_parameters_from_one_json(tmp_path):
    from autoscaler.policy.controller import make_policy
    from contracts.config import ConfigError, load_settings

    def policy(name: str, params: str):
        return make_policy(load_settings(environ={"QUART_POLICY": name, "QUART_POLICY_PARAMS": params,
                                                  "QUART_HOME": str(tmp_path)}), "llama-7b")
    flow = policy("quart-flow", '{"calm_utilization": 0.6, "target_utilization": 0.8, "kp": 1.5}')
    assert (flow.flow.calm_utilization, flow.flow.target_utilization, flow.corrector.config.kp) == (0.6, 0.8, 1.5)
    assert policy("quart-flow", "{}").flow == BacklogFlow()
    with pytest.raises(ConfigError, match="target_utilization"):
        policy("quart-flow", '{"target_utilization": 1.5}')
    with pytest.raises(ConfigError, match="PIDConfig has no"):
        policy("quart", '{"target_utilization": 0.5}')  # the paper's QUART has no flow sizing


def test_quart_runs_every_mechanism_from_the_shipped_artefacts_unless_ablated(tmp_path):
    from autoscaler.policy.controller import make_policy
    from contracts.config import load_settings

    def quart(**env: str):
        return make_policy(load_settings(environ={"QUART_POLICY": "quart", "QUART_HOME": str(tmp_path), **env}), "smollm2")
    full = quart()
    assert full.smoother.model is not None and sorted(full.compensator.fits) == [0, 1, 2, 3] and full.flow is None
    assert quart(QUART_ABLATE="attention").smoother.model is None
    assert quart(QUART_ABLATE="compensator").compensator is None
    assert make_policy(load_settings(environ={"QUART_POLICY": "quart-flow", "QUART_HOME": str(tmp_path)}),
                       "llama-7b").flow is not None


def test_a_missing_artefact_is_an_error_naming_the_command_that_makes_it(tmp_path, monkeypatch):
    import pytest

    from autoscaler.policy.controller import make_policy
    from contracts import artefacts
    from contracts.config import ConfigError, load_settings
    settings = load_settings(environ={"QUART_POLICY": "quart", "QUART_HOME": str(tmp_path)})
    with pytest.raises(ConfigError, match="python -m tools.profile_cpu --model my-model"):
        make_policy(settings, "my-model")
    monkeypatch.setattr(artefacts, "SHIPPED", tmp_path / "nothing-shipped")
    with pytest.raises(ConfigError, match="python -m tools.artefacts --only cv"):
        make_policy(settings, "llama-7b")
    # `make up` refuses before it starts anything, with the same message.
    from contracts.paths import REPO_ROOT
    from runtime.__main__ import check_policy
    with pytest.raises(ConfigError, match="tools.artefacts"):
        check_policy(settings.replace(stack_file=str(REPO_ROOT / "stack-emulated.yml")))
    check_policy(settings.replace(stack_file=str(REPO_ROOT / "stack-emulated.yml"), ablate="attention,compensator"))
    # A user's own artefacts in QUART_HOME are found first.
    (tmp_path / "my-model.cpu_fits.json").write_text('{"0": {"b0": 0.01, "b1": 0.02, "b2": 0.0}}')
    assert make_policy(settings.replace(ablate="attention"), "my-model").compensator.fits[0].b3 == 0.0


def test_plain_names_run_the_documented_defaults_and_tuned_ones_say_so():
    assert BASELINES["openfaas-pro-rps"].target_rps == 50.0 and BASELINES["openfaas-pro-rps"].target_proportion == 0.9
    assert BASELINES["knative-kpa"].target == 70.0  # 100 concurrent at 70 %
    assert BASELINES["ray-serve"].target_ongoing_requests == 2.0 and BASELINES["ray-serve"].upscale_delay_s == 30.0
    assert {"openfaas-pro-rps-tuned", "knative-kpa-tuned", "ray-serve-tuned"} <= set(BASELINES)
    assert BASELINES["knative-kpa-tuned"].target == 1.0  # one item in flight per replica
