"""The live control loop: every tick, observe every model's stages in Redis, run the one control
step (autoscaler.policy.controller, which the cluster simulator runs too), and carry its actions
out: key stages to Redis (the KeysManagers cache them), replica and CPU changes through the
backend, and every decision with its reason to a Redis stream and to the log."""
from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import redis

from autoscaler.backends import Backend
from autoscaler.host_cpu import HostCpu
from autoscaler.layout import LayoutController
from autoscaler.observe import Observer
from autoscaler.policy.controller import Actions, Controller, enact
from autoscaler.policy.layout import CONSOLIDATING, PIPELINED, LayoutRule
from contracts.config import Settings
from contracts.loops import every_in_thread
from contracts.stack import Pipeline
from contracts.stage import StageRef
from pipeline.profiles import profile
from state.store import RedisStore

log = logging.getLogger("quart.autoscaler")


@dataclass
class ControlLoop:
    settings: Settings
    backend: Backend
    r: redis.Redis
    pipelines: dict[str, Pipeline]
    controller: Controller = field(init=False)
    observer: Observer = field(init=False)
    layouts: dict[str, LayoutController] = field(init=False)
    host_cpu: HostCpu = field(default_factory=HostCpu)

    def __post_init__(self) -> None:
        stages = {m: p.stages for m, p in self.pipelines.items()}
        self.controller = Controller.from_settings(self.settings, stages)
        graphs = {m: graph for m, p in self.pipelines.items() if p.emulated and (graph := profile(p.emulated).edges)}
        self.observer = Observer(self.r, stages, self.settings.autoscaler.window_s, graphs)
        a = self.settings.autoscaler
        self.layouts = {m: LayoutController(self.r, self.backend, p, LayoutRule(
            a.layout_windows, self.settings.batching.max_batch, p.whole_max), a.layout_window_s,
            self.settings.data.records_maxlen)
            for m, p in self.pipelines.items() if p.whole}
        # What exists now (torch, the policies, the models) lives as long as the loop: keep it out
        # of the collector's full passes, which would otherwise stall ticks that allocate a lot.
        gc.collect()
        gc.freeze()

    def tick(self, now: float | None = None) -> list[Actions]:
        now = time.time() if now is None else now
        observations = self.observer.observe(now, self.backend.desired_replicas(), self.settings.autoscaler.slo_s)
        # A model the gateway put to sleep (scale to zero) is left alone until a request wakes it.
        asleep = RedisStore(self.r).asleep(list(observations))
        # A model served by whole-model replicas (or on its way to or from them) is the layout's.
        whole = {m for m, layout in self.layouts.items()
                 if m not in asleep and self._layout_step(layout, now) not in (PIPELINED, CONSOLIDATING)}
        observations = {m: s for m, s in observations.items() if m not in asleep | whole}
        # This host's idle cores say what a replica more would find only where replicas run here.
        if self.settings.autoscaler.backend == "local" and self.settings.compute.device == "cpu":
            free = self.host_cpu.idle_cores()
            observations = {m: s if self.pipelines[m].emulated else replace(s, cpu_free=free)
                            for m, s in observations.items()}
        steps = self.controller.step(now, observations)
        for actions in steps:
            enact(self, actions, log)
            self._record(actions)
        return steps

    def _layout_step(self, layout: LayoutController, now: float) -> str:
        """The model's layout after this tick's step (a change is recorded with its reason)."""
        decision = layout.step(now)
        return layout.layout() if decision is None else decision.layout

    # -- the Mechanism the controller's actions go through ---------------------------------------

    def publish_key_stages(self, model: str, stages: tuple[StageRef, ...]) -> None:
        RedisStore(self.r).publish_key_stages(model, stages)

    def set_replicas(self, stage: StageRef, replicas: int) -> None:
        self.backend.set_replicas(stage, replicas)

    def set_cpus(self, stage: StageRef, cpus: int) -> None:
        self.backend.set_cpus(stage, cpus)

    def _record(self, actions: Actions) -> None:
        RedisStore(self.r).add_decision(actions.model, actions.record(), self.settings.data.records_maxlen)
        log.log(*actions.log_line())

    def run(self, stop: Callable[[], bool]) -> None:
        """Ticks at the configured period until `stop()` is true; a failing tick is logged."""
        every_in_thread(self.settings.autoscaler.tick_s, self.tick, stop, log, "tick")
