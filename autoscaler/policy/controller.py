"""The one control step that the live loop and the cluster simulator both run:
`Controller.step(now, observations) -> [Actions]`, the one decider of replica counts. Per model it
first rules between the autoscaling policy and the layout and idle rules
(autoscaler/policy/arbitration.py), then runs the policy where the ruling leaves it the stage
functions (QUART's CV prediction batched over every model that shares a CV-attention model),
applies the replica bounds once, and says what changes: replica counts, CPUs, the key stages to
publish, the whole function's replicas, the layout and sleep, and the decision's log record. No
I/O: the caller observes, and carries the actions out with `enact`.

Like Knative's MultiScaler, a model with no observation this tick gets no decision (its policy
memory is kept), rather than a decision made on missing data."""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, fields, replace
from typing import Protocol

from autoscaler.policy.arbitration import POLICY, ModelRules, Ruling, rule
from autoscaler.policy.backlog_flow import BacklogFlow
from autoscaler.policy.baselines import BASELINES
from autoscaler.policy.compensator import Compensator, CPUFit, load_fits, within_total
from autoscaler.policy.contract import Forecast, Policy
from autoscaler.policy.corrector import Corrector, PIDConfig
from autoscaler.policy.cpu_guard import hold_without_cpu
from autoscaler.policy.layout import LayoutDecision, LayoutRule
from autoscaler.policy.quart import Quart
from autoscaler.policy.smoother import CVAttention, Smoother
from autoscaler.policy.state import Decision, PipelineState
from contracts import artefacts
from contracts.config import Bounds, ConfigError, Settings, from_params
from contracts.stack import Pipeline
from contracts.stage import StageRef
from state.records import DecisionRecord

# Every policy a user can name: QUART's variants (the paper's, and quart-flow, which sizes stages ahead of a
# burst's backlog), then each baseline at its documented defaults and tuned.
VARIANTS = ("quart", "quart-flow")
POLICIES = (*VARIANTS, *BASELINES)


def load_cv_model(settings: Settings) -> CVAttention:
    """The trained CV-attention model: QUART_HOME's, else the shipped one; ConfigError naming
    the command that makes it when there is neither."""
    path = artefacts.find(settings.home, artefacts.CV_MODEL)
    if path is None:
        raise ConfigError(f"no trained CV-attention model ({artefacts.CV_MODEL} in {settings.home} or "
                          f"{artefacts.SHIPPED}): make it with `{artefacts.MAKE_ALL} --only cv`, "
                          "or run without it: QUART_ABLATE=attention")
    return CVAttention.load(path)


def load_cpu_fits(settings: Settings, model: str) -> dict[int, CPUFit]:
    """A model's CPU fits: QUART_HOME's, else the shipped ones; ConfigError naming the command
    that makes them when there are neither."""
    name = artefacts.cpu_fits_name(model)
    path = artefacts.find(settings.home, name)
    if path is None:
        raise ConfigError(f"no CPU fits for {model!r} ({name} in {settings.home} or {artefacts.SHIPPED}): "
                          f"profile it with `{artefacts.make_fits_command(model, settings.home)}`, "
                          "or run without the compensator: QUART_ABLATE=compensator")
    return load_fits(path)


def make_policy(settings: Settings, model: str, cv_model: CVAttention | None = None,
                fits: dict[int, CPUFit] | None = None) -> Policy:
    """The configured policy for one model. QUART runs every mechanism that QUART_ABLATE leaves
    on: the trained CV model and the model's CPU fits (`fits` given: those, {} for a model with no
    CPU law) from the artefacts. ConfigError for an unknown policy or parameter, or a missing
    artefact."""
    cfg = settings.autoscaler
    if cfg.policy in BASELINES:
        return from_params(BASELINES[cfg.policy], cfg.policy_params, "QUART_POLICY_PARAMS")
    if cfg.policy not in VARIANTS:
        raise ConfigError(f"QUART_POLICY={cfg.policy!r}: choose none or one of {list(POLICIES)}")
    cv_model = None if cfg.ablated("attention") else cv_model or load_cv_model(settings)
    compensator = None
    if not cfg.ablated("compensator"):
        fits = load_cpu_fits(settings, model) if fits is None else fits
        compensator = Compensator(fits, cpu_max=cfg.cpu_max) if fits else None
    pid, flow = _variant_params(cfg.policy, cfg.tick_s, cfg.policy_params)
    return Quart(Corrector(pid), Smoother(cv_model), compensator, flow, name=cfg.policy)


def _variant_params(policy: str, tick_s: float, params: dict) -> tuple[PIDConfig, BacklogFlow | None]:
    """A QUART variant's QUART_POLICY_PARAMS: the PID's fields, and quart-flow's also the flow's."""
    flow_fields = {f.name for f in fields(BacklogFlow)} if policy == "quart-flow" else set()
    pid = from_params(PIDConfig, {"period_s": tick_s, **{k: v for k, v in params.items() if k not in flow_fields}},
                      "QUART_POLICY_PARAMS")
    if policy != "quart-flow":
        return pid, None
    return pid, from_params(BacklogFlow, {k: v for k, v in params.items() if k in flow_fields}, "QUART_POLICY_PARAMS")


def model_rules(settings: Settings, pipeline: Pipeline) -> ModelRules:
    """A model's layout and idle rules, from its stack file's functions and the settings."""
    a = settings.autoscaler
    layout = LayoutRule(a.layout_windows, settings.batching.max_batch, pipeline.whole_max,
                        a.layout_window_s) if pipeline.whole else None
    return ModelRules(layout, tuple(pipeline.stages.index(ref) for ref in pipeline.sleepers), max(1, a.bounds.r_min),
                      pipeline.idle_s)


@dataclass(frozen=True)
class Actions:
    """What one model's decision and ruling change, and its record. `decision` is None where the
    ruling left the policy out (a model asleep, or served whole)."""
    state: PipelineState
    decision: Decision | None
    stages: tuple[StageRef, ...]
    replicas: tuple[tuple[StageRef, int], ...]     # stage function -> new replica count
    cpus: tuple[tuple[StageRef, int], ...]         # stage function -> new CPUs per replica
    key_stages: tuple[StageRef, ...]
    whole: int | None = None                       # the whole-model function's new replica count
    layout: LayoutDecision | None = None           # a change of layout, to record
    asleep: bool | None = None                     # True: put to sleep; False: woken

    @property
    def model(self) -> str:
        return self.state.model

    @property
    def empty(self) -> bool:
        return self.decision is None and not self.replicas and self.whole is None and self.layout is None \
            and self.asleep is None

    def record(self) -> DecisionRecord:
        """The decision as the live loop logs it (the stream quart:decisions:<model>); only for
        actions with a decision."""
        state, decision = self.state, self.decision
        assert decision is not None
        return DecisionRecord(state.now, decision.policy, tuple(s.replicas for s in state.stages),
                              tuple(decision.replicas()), tuple(s.stages for s in self.key_stages),
                              tuple({"stage": ref.stages, "observed_replicas": s.replicas, "replicas": d.replicas,
                                     "cpus": d.cpus, "key": d.key, "queue": s.queue_length,
                                     "busy": round(s.busy_fraction, 3), **{k: readable(v) for k, v in d.reason.items()}}
                                    for ref, s, d in zip(self.stages, state.stages, decision.stages)))

    def log_line(self) -> tuple[int, str]:
        """INFO with the reasons of the stages that change; DEBUG when nothing changes."""
        if self.decision is None:
            what = f"layout {self.layout.layout} ({self.layout.reason})" if self.layout else \
                "asleep" if self.asleep else "woken" if self.asleep is False else "held"
            return logging.INFO, f"{self.model}: {what}; " + ", ".join(f"s{ref.stages} -> {n}" for ref, n in self.replicas)
        changed = [(ref, s, d) for ref, s, d in zip(self.stages, self.state.stages, self.decision.stages)
                   if s.replicas != d.replicas]
        text = "; ".join(f"s{ref.stages} {s.replicas}->{d.replicas} "
                         + " ".join(f"{k}={readable(v)}" for k, v in d.reason.items()) for ref, s, d in changed)
        return (logging.INFO if changed else logging.DEBUG,
                f"{self.model} {self.decision.policy}: {text or 'no change'}; key stages "
                f"{[s.stages for s in self.key_stages]}")


def readable(value: object) -> object:
    """Reasons as a person reads them: rounded, and infinity spelled out (JSON has none)."""
    if isinstance(value, float):
        return round(value, 4) if math.isfinite(value) else "inf"
    return value


@dataclass
class Controller:
    """Per model: its stage functions in pipeline order and its policy."""
    pipelines: dict[str, tuple[StageRef, ...]]
    policies: dict[str, Policy]
    bounds: Bounds = field(default_factory=Bounds)
    memory: dict[str, object] = field(default_factory=dict)
    cpu_total: int = 0          # R_total (QUART_CPU_TOTAL); 0: no bound
    rules: dict[str, ModelRules] = field(default_factory=dict)  # layout and idle rules, per model that has them

    @classmethod
    def from_settings(cls, settings: Settings, pipelines: dict[str, tuple[StageRef, ...]],
                      fits: dict[str, dict[int, CPUFit]] | None = None,
                      rules: dict[str, ModelRules] | None = None) -> Controller:
        """`fits`: CPU fits per model where the caller has them (the simulator, from the service
        law it simulates); the others' come from the artefacts. `rules`: the models' layout and
        idle rules (`model_rules`)."""
        # One CV model for every model's policy, so that their predictions batch together.
        cfg = settings.autoscaler
        quart = cfg.policy in VARIANTS and not cfg.ablated("attention")
        cv_model = load_cv_model(settings) if quart else None
        fits = fits or {}
        return cls(pipelines, {m: make_policy(settings, m, cv_model, fits.get(m)) for m in pipelines},
                   settings.autoscaler.bounds, cpu_total=cfg.cpu_total, rules=rules or {})

    def step(self, now: float, observations: dict[str, PipelineState]) -> list[Actions]:
        states = {m: replace(observations[m], bounds=self.bounds, now=now)
                  for m in self.pipelines if m in observations and observations[m].stages}
        rulings = {m: rule(s, self.rules[m]) if m in self.rules else POLICY for m, s in states.items()}
        decided = self._decide({m: s for m, s in states.items() if rulings[m].policy})
        if self.cpu_total > 0 and decided:
            models = list(decided)
            bounded = within_total([states[m] for m in models], [decided[m] for m in models], self.cpu_total)
            decided = dict(zip(models, bounded))
        actions = (self._actions(states[m], decided.get(m), rulings[m]) for m in self.pipelines if m in states)
        return [a for a in actions if not a.empty]

    def _decide(self, states: dict[str, PipelineState]) -> dict[str, Decision]:
        # One forecast for every model whose policies share it (QUART's CV attention: one batched pass).
        groups: dict[Forecast | None, list[str]] = {}
        for m in states:
            groups.setdefault(self.policies[m].forecast(), []).append(m)
        out = {}
        for forecast, models in groups.items():
            predicted = forecast.predict([states[m] for m in models]) if forecast is not None else [None] * len(models)
            for m, part in zip(models, predicted):
                out[m], self.memory[m] = self.policies[m].decide(states[m], self.memory.get(m), part)
        return out

    def _actions(self, state: PipelineState, decision: Decision | None, ruling: Ruling) -> Actions:
        refs = self.pipelines[state.model]
        ruled = tuple((refs[i], n) for i, n in ruling.replicas if n != state.stages[i].replicas)
        changes = dict(whole=ruling.whole, layout=ruling.layout, asleep=ruling.asleep)
        if decision is None:
            return Actions(state, None, refs, ruled, (), (), **changes)
        decision = hold_without_cpu(state, decision.bounded(self.bounds))
        replicas = tuple((ref, d.replicas) for ref, s, d in zip(refs, state.stages, decision.stages)
                         if d.replicas != s.replicas)
        # CPUs change only by whole cores, and never below one.
        cpus = tuple((ref, int(round(d.cpus))) for ref, s, d in zip(refs, state.stages, decision.stages)
                     if round(d.cpus) != round(s.cpus) and d.cpus >= 1)
        keys = tuple(ref for ref, d in zip(refs, decision.stages) if d.key)
        return Actions(state, decision, refs, replicas, cpus, keys, **changes)


class Mechanism(Protocol):
    """How actions take effect: the live loop's Redis and gateway, or the simulated cluster."""
    def publish_key_stages(self, model: str, stages: tuple[StageRef, ...]) -> None: ...
    def set_replicas(self, stage: StageRef, replicas: int) -> None: ...
    def set_cpus(self, stage: StageRef, cpus: int) -> None: ...
    def set_whole(self, model: str, replicas: int) -> None: ...
    def set_layout(self, model: str, change: LayoutDecision) -> None: ...
    def set_asleep(self, model: str, asleep: bool) -> None: ...


def enact(mechanism: Mechanism, actions: Actions, log: logging.Logger) -> list[str]:
    """Key stages first (the scheduler places the replicas asked for next by them), then the whole
    function's and every stage's replica and CPU change, then the layout and sleep marks (set
    once the counts they describe are asked for). A change that fails is logged and the others
    still go through: one stage's error never holds back another stage's or another model's.
    Returns the failures."""
    failures = []
    model = actions.model
    if actions.decision is not None:
        mechanism.publish_key_stages(model, actions.key_stages)
    changes = ([(mechanism.set_whole, model, actions.whole)] if actions.whole is not None else []) + \
              [(mechanism.set_replicas, ref, n) for ref, n in actions.replicas] + \
              [(mechanism.set_cpus, ref, n) for ref, n in actions.cpus]
    for apply, target, n in changes:
        try:
            apply(target, n)
        except (RuntimeError, OSError, ValueError) as exc:
            failures.append(f"{target}: {exc}")
            log.warning("%s %s to %d failed: %s", apply.__name__, target, n, exc)
    if actions.layout is not None:
        mechanism.set_layout(model, actions.layout)
    if actions.asleep is not None:
        mechanism.set_asleep(model, actions.asleep)
    return failures
