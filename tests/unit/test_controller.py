"""The one control step (autoscaler.policy.controller), table-driven like Knative's scaling tests:
the clock is the caller's, missing data means no decision, bounds are applied once, key stages
are published as the stage functions' ranges, and one failing change holds back no other."""
from __future__ import annotations

import dataclasses
import logging

import pytest

from autoscaler.policy.baselines import Static
from autoscaler.policy.controller import Controller, enact
from autoscaler.policy.quart import Quart
from autoscaler.policy.state import PipelineState, StageState
from contracts.config import Bounds
from contracts.stage import StageRef

A = (StageRef("a", 0, 1), StageRef("a", 1, 3), StageRef("a", 3, 4))   # the middle function serves 1-3
B = (StageRef("b", 0, 1), StageRef("b", 1, 2))


def state(model: str, n: int, replicas: int = 1, lam: float = 2.0, queue: tuple[int, ...] = ()) -> PipelineState:
    queue = queue or (0,) * n
    return PipelineState(model, tuple(StageState(stage=i, arrival_rate=lam, service_time_s=0.05, replicas=replicas,
                                                 queue_length=queue[i]) for i in range(n)), slo_s=2.0, entry_rate=lam)


@pytest.mark.parametrize("name,static,bounds,observed,want", [
    ("within bounds: as decided", 3, Bounds(1, 16), 1, 3),
    ("above r_max: clamped", 40, Bounds(1, 16), 1, 16),
    ("below r_min: raised", 1, Bounds(2, 16), 2, 2),
    ("r_max above the old cap of 16", 30, Bounds(1, 64), 1, 30),
])
def test_bounds_are_applied_once(name, static, bounds, observed, want):
    c = Controller({"a": A}, {"a": Static(static)}, bounds)
    [actions] = c.step(5.0, {"a": state("a", 3, observed)})
    assert actions.decision.replicas() == [want] * 3
    assert actions.replicas == (() if want == observed else tuple((ref, want) for ref in A))
    if static != want:
        assert actions.decision.stages[0].reason["bounded_from"] == static


def test_no_observation_no_decision_and_memory_kept():
    c = Controller({"a": A, "b": B}, {"a": Quart(), "b": Quart()})
    c.step(1.0, {"a": state("a", 3), "b": state("b", 2)})
    memory_b = c.memory["b"]
    steps = c.step(2.0, {"a": state("a", 3)})        # b's observation is missing this tick
    assert [s.model for s in steps] == ["a"] and c.memory["b"] is memory_b


def test_the_clock_is_the_callers():
    c = Controller({"a": A}, {"a": Static(1)})
    [actions] = c.step(123.5, {"a": state("a", 3)})
    assert actions.state.now == 123.5 and actions.record().t == 123.5


def test_key_stages_are_published_as_the_functions_ranges():
    # The middle function (stages 1-3) has the long queue: it is key, and what is published is
    # its range "1-3", which a KeysManager can cache (an index 1 would match no function).
    c = Controller({"a": A}, {"a": Quart()})
    [actions] = c.step(1.0, {"a": state("a", 3, lam=30.0, queue=(0, 50, 0))})
    assert StageRef("a", 1, 3) in actions.key_stages
    assert "1-3" in actions.record().key


def test_quart_cv_prediction_is_batched_over_models_and_equals_one_at_a_time():
    together = Controller({"a": A, "b": B}, {"a": Quart(), "b": Quart()})
    alone = Controller({"a": A}, {"a": Quart()})
    obs = {"a": state("a", 3, lam=30.0, queue=(0, 50, 0)), "b": state("b", 2)}
    assert together.step(1.0, obs)[0].decision == alone.step(1.0, {"a": obs["a"]})[0].decision


class Recorder:
    def __init__(self, failing: StageRef | None = None) -> None:
        self.failing, self.calls = failing, []

    def publish_key_stages(self, model, stages):
        self.calls.append(("key", model, stages))

    def set_replicas(self, stage, replicas):
        if stage == self.failing:
            raise RuntimeError("the gateway answered 400")
        self.calls.append(("replicas", stage, replicas))

    def set_cpus(self, stage, cpus):
        self.calls.append(("cpus", stage, cpus))


def test_one_failing_change_holds_back_no_other():
    c = Controller({"a": A, "b": B}, {"a": Static(3), "b": Static(3)})
    steps = c.step(1.0, {"a": state("a", 3), "b": state("b", 2)})
    mechanism = Recorder(failing=A[0])
    failures = [enact(mechanism, s, logging.getLogger("test")) for s in steps]
    assert len(failures[0]) == 1 and failures[1] == []
    done = [call[1] for call in mechanism.calls if call[0] == "replicas"]
    assert done == [A[1], A[2], B[0], B[1]]
    assert mechanism.calls[0][0] == "key"  # key stages go out before any replica change


@pytest.mark.parametrize("name,cpu_free,observed,static,want", [
    ("not measured: as decided", None, 2, 5, 5),
    ("idle cores: as decided", 1.5, 2, 5, 5),
    ("no idle core: scale-up held", 0.1, 2, 5, 2),
    ("no idle core: scale-down goes ahead", 0.1, 4, 2, 2),
])
def test_no_replica_is_added_where_no_core_is_idle(name, cpu_free, observed, static, want):
    c = Controller({"a": A}, {"a": Static(static)}, Bounds(1, 16))
    observed_state = state("a", 3, observed)
    [actions] = c.step(5.0, {"a": PipelineState(**{**vars(observed_state), "cpu_free": cpu_free})})
    assert actions.decision.replicas() == [want] * 3
    assert ("held" in actions.decision.stages[0].reason) == (static > observed and want == observed)


def test_policies_sharing_a_forecast_are_predicted_together_and_each_decides_on_its_part():
    calls: list[list[str]] = []

    @dataclasses.dataclass(frozen=True)
    class Counted:
        """A CV forecast that notes which models each call predicted (and predicts CV 1 everywhere)."""
        def predict(self, states):
            calls.append([s.model for s in states])
            return [[1.0] * len(s.stages) for s in states]

    shared = Counted()
    policies = {"a": _ForecastBy(Quart(), shared), "b": _ForecastBy(Quart(), shared), "c": Static(2)}
    c = Controller({"a": A, "b": B, "c": (StageRef("c", 0, 1),)}, policies)
    steps = c.step(1.0, {"a": state("a", 3), "b": state("b", 2), "c": state("c", 1)})
    assert calls == [["a", "b"]]                       # one pass for both QUART models, none for the baseline
    assert [s.model for s in steps] == ["a", "b", "c"]
    assert [s.decision.policy for s in steps] == ["quart", "quart", "static"]


@dataclasses.dataclass(frozen=True)
class _ForecastBy:
    """A policy with its forecast swapped for another (to count the controller's calls)."""
    policy: Quart
    by: object

    def forecast(self):
        return self.by

    def decide(self, state, memory=None, predicted=None):
        assert predicted is not None, "the controller hands each policy its part of the forecast"
        return self.policy.decide(state, memory, predicted)
