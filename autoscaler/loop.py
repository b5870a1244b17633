"""The live control loop: every tick, observe every model's stages in Redis, run the one control
step (autoscaler.policy.controller, which the cluster simulator runs too: the policy, and the
layout and idle rules beside it), and carry its actions out: key stages to Redis (the KeysManagers
cache them), replica and CPU changes through the backend, layout changes and sleep marks to Redis,
and every decision with its reason to a Redis stream and to the log."""
from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from autoscaler.backends import Backend
from autoscaler.host_cpu import HostCpu
from autoscaler.metrics import AutoscalerMetrics
from autoscaler.observe import Observer
from autoscaler.policy import idle
from autoscaler.policy.controller import Actions, Controller, enact, model_rules
from autoscaler.policy.layout import LayoutDecision
from autoscaler.policy.state import PipelineState
from contracts.config import Settings
from contracts.loops import every_in_thread
from contracts.stack import Pipeline
from contracts.stage import StageRef
from models.profiles import profile
from scheduler.wake_layout import WakeChoice, choose
from state.records import LayoutChange
from state.store import Store, cold_start_costs

log = logging.getLogger("quart.autoscaler")


@dataclass
class ControlLoop:
    settings: Settings
    backend: Backend
    store: Store
    pipelines: dict[str, Pipeline]
    controller: Controller = field(init=False)
    observer: Observer = field(init=False)
    host_cpu: HostCpu = field(default_factory=HostCpu)
    metrics: AutoscalerMetrics | None = None
    now: float = 0.0

    def __post_init__(self) -> None:
        stages = {m: p.stages for m, p in self.pipelines.items()}
        rules = {m: r for m, p in self.pipelines.items() if (r := model_rules(self.settings, p)).layout or r.sleepers}
        self.controller = Controller.from_settings(self.settings, stages, rules=rules)
        graphs = {m: graph for m, p in self.pipelines.items() if p.emulated and (graph := profile(p.emulated).edges)}
        self.observer = Observer(self.store, stages, self.settings.autoscaler.window_s, graphs, rules)
        # What exists now (torch, the policies, the models) lives as long as the loop: keep it out
        # of the collector's full passes, which would otherwise stall ticks that allocate a lot.
        gc.collect()
        gc.freeze()

    def tick(self, now: float | None = None) -> list[Actions]:
        started = time.perf_counter()
        steps = self._tick(now)
        if self.metrics is not None:
            self.metrics.observe_tick(time.perf_counter() - started, steps)
        return steps

    def _tick(self, now: float | None) -> list[Actions]:
        self.now = now = time.time() if now is None else now
        whole = {m: self.backend.function_replicas(p.whole) for m, p in self.pipelines.items() if p.whole}
        observations = self.observer.observe(now, self.backend.desired_replicas(), self.settings.autoscaler.slo_s,
                                             whole)
        # This host's idle cores say what a replica more would find only where replicas run here.
        if self.settings.autoscaler.backend == "local" and self.settings.compute.device == "cpu":
            free = self.host_cpu.idle_cores()
            observations = {m: s if self.pipelines[m].emulated else replace(s, cpu_free=free)
                            for m, s in observations.items()}
        steps = self.controller.step(now, self._wake_layouts(observations))
        for actions in steps:
            enact(self, actions, log)
            if actions.decision is not None:
                self.store.add_decision(actions.model, actions.record(), self.settings.data.records_maxlen)
            log.log(*actions.log_line())
        return steps

    def _wake_layouts(self, states: dict[str, PipelineState]) -> dict[str, PipelineState]:
        """For a model that work is about to wake, all its stage functions asleep and a whole-model
        function beside them: the layout Algorithm 1 chooses over the backend's servers (read
        only then: it asks the cluster)."""
        for m, s in states.items():
            p = self.pipelines[m]
            if p.whole and s.asleep and len(p.sleepers) == len(p.stages) and s.activity is not None \
                    and idle.decide(s.now, s.activity) == "wake":
                states[m] = replace(s, wake=self._wake_choice(p))
        return states

    def _wake_choice(self, p: Pipeline) -> WakeChoice | None:
        costs, load_rate = cold_start_costs(self.store, list(p.stages))
        servers = self.backend.cold_servers(load_rate)
        if not servers:
            return None  # no view of the servers: it wakes as its stage functions
        try:
            return choose(costs, sum(self.backend.shard_bytes(s) for s in p.stages), servers, len(p.stages), p.ttft_slo_s)
        except ValueError as exc:
            log.warning("%s wakes as its stage functions: %s", p.model, exc)
            return None

    # -- the Mechanism the controller's actions go through ---------------------------------------

    def publish_key_stages(self, model: str, stages: tuple[StageRef, ...]) -> None:
        self.store.publish_key_stages(model, stages)

    def set_replicas(self, stage: StageRef, replicas: int) -> None:
        self.backend.set_replicas(stage, replicas)

    def set_cpus(self, stage: StageRef, cpus: int) -> None:
        self.backend.set_cpus(stage, cpus)

    def set_whole(self, model: str, replicas: int) -> None:
        self.backend.scale_function(self.pipelines[model].whole, replicas)

    def set_layout(self, model: str, change: LayoutDecision) -> None:
        self.store.set_layout(model, LayoutChange(self.now, change.layout, change.reason),
                              self.settings.data.records_maxlen)

    def set_asleep(self, model: str, asleep: bool) -> None:
        if asleep:
            self.store.set_asleep(model, self.now)
        else:  # woken from zero: its entry admits requests to queue behind the stages' start
            self.store.wake(model, self.now, self.settings.data.request_timeout_s)

    def run(self, stop: Callable[[], bool]) -> None:
        """Ticks at the configured period until `stop()` is true; a failing tick is logged."""
        every_in_thread(self.settings.autoscaler.tick_s, self.tick, stop, log, "tick")
