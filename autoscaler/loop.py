"""The live control loop: every tick, observe each model's stages in Redis, run the policy, apply
what changed through the backend, publish the key stages (the KeysManagers cache them), and log
every decision with its reason to a Redis stream and to the log."""
from __future__ import annotations

import gc
import json
import logging
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import redis

from autoscaler.backends import Backend
from autoscaler.observe import Observer
from autoscaler.policy.baselines import BASELINES
from autoscaler.policy.compensator import Compensator, load_fits
from autoscaler.policy.corrector import Corrector, PIDConfig
from autoscaler.policy.quart import Quart
from autoscaler.policy.smoother import CVAttention, Smoother
from autoscaler.policy.state import Decision, PipelineState
from contracts import keys
from contracts.config import Settings

log = logging.getLogger("quart.autoscaler")
CV_MODEL_FILE = "cv_attention.pt"
CPU_FITS_FILE = "cpu_fits.json"


def make_policy(settings: Settings, model: str) -> object:
    """The configured policy. QUART uses a trained CV model and CPU fits where they exist in
    QUART_HOME (cv_attention.pt, cpu_fits.json); without them it smooths on observed CVs and
    leaves CPUs alone."""
    params = json.loads(settings.policy_params) if settings.policy_params else {}
    if settings.policy in BASELINES:
        return replace(BASELINES[settings.policy], **params)
    if settings.policy != "quart":
        raise ValueError(f"unknown policy {settings.policy!r}; choose quart or one of {sorted(BASELINES)}")
    home = Path(settings.home)
    cv_model = CVAttention.load(home / CV_MODEL_FILE) if (home / CV_MODEL_FILE).exists() else None
    fits_path = home / f"{model}.{CPU_FITS_FILE}"
    compensator = Compensator(load_fits(fits_path), cpu_max=settings.cpu_max, r_max=settings.r_max) \
        if fits_path.exists() else None
    pid = PIDConfig(**{"period_s": settings.tick_s, "r_max": settings.r_max, **params})
    return Quart(Corrector(pid),
                 Smoother(cv_model), compensator)


def enact(backend: Backend, state: PipelineState, decision: Decision) -> None:
    """What a decision changes goes to the backend: replica counts, and CPUs where they moved by
    a whole core. The live loop and the cluster simulator both apply decisions with it."""
    for s, d in zip(state.stages, decision.stages):
        if d.replicas != s.replicas:
            backend.set_replicas(state.model, d.stage, d.replicas)
        if round(d.cpus) != round(s.cpus) and d.cpus >= 1:
            backend.set_cpus(state.model, d.stage, int(round(d.cpus)))


def _readable(value: object) -> object:
    """Reasons as a person reads them: rounded, and infinity spelled out (JSON has none)."""
    if isinstance(value, float):
        return round(value, 4) if math.isfinite(value) else "inf"
    return value


@dataclass
class ControlLoop:
    settings: Settings
    backend: Backend
    r: redis.Redis
    models: dict[str, int]                     # model -> number of stages
    policies: dict[str, object] = field(default_factory=dict)
    memory: dict[str, object] = field(default_factory=dict)
    observers: dict[str, Observer] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for model, stages in self.models.items():
            self.policies[model] = make_policy(self.settings, model)
            self.observers[model] = Observer(self.r, model, stages, self.settings.window_s)
        # What exists now (torch, the policies, the models) lives as long as the loop: keep it out
        # of the collector's full passes, which would otherwise stall ticks that allocate a lot.
        gc.collect()
        gc.freeze()

    def tick(self, now: float | None = None) -> list[Decision]:
        now = time.time() if now is None else now
        decisions = []
        for model, stages in self.models.items():
            desired = self.backend.desired_replicas(model, stages)
            state = self.observers[model].observe(now, desired, self.settings.slo_s)
            decision, self.memory[model] = self.policies[model].decide(state, self.memory.get(model))
            self._apply(model, state, decision)
            decisions.append(decision)
        return decisions

    def _apply(self, model: str, state: PipelineState, decision: Decision) -> None:
        # Key stages first: the scheduler places the replicas asked for next by them.
        pipe = self.r.pipeline()
        pipe.delete(keys.key_stages(model))
        if decision.key_stages:
            pipe.sadd(keys.key_stages(model), *[str(i) for i in decision.key_stages])
        pipe.execute()
        enact(self.backend, state, decision)
        pipe = self.r.pipeline()
        pipe.xadd(keys.decisions(model), {
            "t": f"{state.now:.3f}", "policy": decision.policy,
            "replicas": json.dumps([s.replicas for s in state.stages]),
            "decided": json.dumps(decision.replicas()), "key": json.dumps(decision.key_stages),
            "stages": json.dumps([{"stage": d.stage, "observed_replicas": s.replicas, "replicas": d.replicas,
                                   "cpus": d.cpus, "key": d.key, "queue": s.queue_length,
                                   **{k: _readable(v) for k, v in d.reason.items()}}
                                  for s, d in zip(state.stages, decision.stages)])},
            maxlen=self.settings.records_maxlen, approximate=True)
        pipe.execute()
        changed = [(s, d) for s, d in zip(state.stages, decision.stages) if s.replicas != d.replicas]
        # Every decision goes to the log: the ones that change something at INFO, with the reasons
        # of the stages they change; the others at DEBUG.
        log.log(logging.INFO if changed else logging.DEBUG, "%s %s: %s; key stages %s", model, decision.policy,
                "; ".join(f"s{d.stage} {s.replicas}->{d.replicas} "
                          + " ".join(f"{k}={_readable(v)}" for k, v in d.reason.items()) for s, d in changed)
                or "no change", list(decision.key_stages))

    def run(self, stop) -> None:
        """Ticks at the configured period until `stop()` is true."""
        while not stop():
            started = time.monotonic()
            try:
                self.tick()
            except (redis.ConnectionError, RuntimeError, OSError) as exc:
                log.warning("tick failed: %s", exc)
            except Exception:  # a policy bug must not stop the loop that keeps the service up
                log.exception("tick failed")
            time.sleep(max(0.0, self.settings.tick_s - (time.monotonic() - started)))
