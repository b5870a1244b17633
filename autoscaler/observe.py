"""Builds each model's observed state from what the data plane leaves in the state store: per
stage function its records (arrival time at the stage, queue wait, service time, replica), its
queue (items still waiting: their arrival times) and its live replicas. Every stage of every model
is read in one batch per tick (`Store.stage_windows`), and of each stage's records only those
written since the last tick (the window's earlier ones are kept here).

For the rules beside the policy (autoscaler/policy/arbitration.py) it also builds, per model that
has them, the layout's view (requests entering the model per window, whole and stage replicas
serving) and the idle rule's (the gateway's activity, the work waiting, and the sleep mark)."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

from autoscaler.policy.arbitration import ModelRules
from autoscaler.policy.idle import ModelActivity
from autoscaler.policy.layout import ArrivalWindows, LayoutState
from autoscaler.policy.state import PipelineState, StageState
from autoscaler.policy.window import Window, stage_state
from contracts.stage import StageRef
from contracts.stage_graph import Edges
from state.records import Activity, ReplicaRecord, StageSample, StageWindow
from state.store import Store


@dataclass
class _Records:
    """The records of one stage seen so far in the window."""
    cursor: str | None = None
    rows: deque[StageSample] = field(default_factory=deque)
    new_starts: int = 0      # requests started among the records the latest tick read

    def add(self, window: StageWindow, since_ms: int) -> None:
        self.rows.extend(window.samples)
        self.cursor = window.cursor
        self.new_starts = sum(x.starts_request for x in window.samples)
        while self.rows and self.rows[0].at_ms < since_ms:
            self.rows.popleft()


@dataclass
class Observer:
    """Remembers each stage's last known service time, so that a stage with no traffic in the
    window still has one."""
    store: Store
    pipelines: dict[str, tuple[StageRef, ...]]
    window_s: float
    graphs: dict[str, Edges] = field(default_factory=dict)  # the models that are not chains
    rules: dict[str, ModelRules] = field(default_factory=dict)  # the models with layout or idle rules
    service_s: dict[StageRef, float] = field(default_factory=dict)
    records: dict[StageRef, _Records] = field(default_factory=dict)
    arrivals: dict[str, ArrivalWindows] = field(default_factory=dict)
    awake_since: dict[str, float] = field(default_factory=dict)  # first seen, or last seen waking
    asleep: set[str] = field(default_factory=set)

    def observe(self, now: float, desired: dict[str, list[int]], slo_s: float,
                whole_desired: dict[str, int] | None = None) -> dict[str, PipelineState]:
        """Every model's state; `desired`: the replicas each stage function is asked to have;
        `whole_desired`: those of each model's whole-model function."""
        since_s = now - self.window_s
        refs = [ref for model in self.pipelines for ref in self.pipelines[model]]
        seen = {ref: self.records.setdefault(ref, _Records()) for ref in refs}
        windows = self.store.stage_windows({(ref.model, ref.first): seen[ref].cursor for ref in refs}, since_s)
        windows = {ref: windows[(ref.model, ref.first)] for ref in refs}
        for ref in refs:
            seen[ref].add(windows[ref], int(since_s * 1000))
        out = {}
        for model, stages in self.pipelines.items():
            states = tuple(self._stage(i, ref, now, desired[model][i], windows[ref]) for i, ref in enumerate(stages))
            out[model] = PipelineState(model, states, slo_s=slo_s, entry_rate=states[0].arrival_rate, now=now,
                                       edges=self.graphs.get(model))
        return self._with_rules(now, out, desired, whole_desired or {}, windows) if self.rules else out

    def _stage(self, index: int, ref: StageRef, now: float, replicas: int, window: StageWindow) -> StageState:
        rows = self.records[ref].rows
        arrivals = [x.arrived_at for x in rows if x.arrived_at >= now - self.window_s] + list(window.backlog.arrivals)
        w = Window.of(arrivals, [x.service_ms / 1000.0 for x in rows], [x.wait_ms / 1000.0 for x in rows])
        if w.finished:
            self.service_s[ref] = w.service_mean
        return stage_state(index, self.window_s, w,
                           self.service_s.get(ref, 0.0), replicas, [float(x.cpus) for x in window.replicas],
                           window.backlog.waiting, window.backlog.in_flight)

    # -- what the rules beside the policy read ---------------------------------------------------

    def _with_rules(self, now: float, states: dict[str, PipelineState], desired: dict[str, list[int]],
                    whole_desired: dict[str, int], windows: dict[StageRef, StageWindow]) -> dict[str, PipelineState]:
        ruled = [m for m in self.rules if m in states]
        sleepy = [m for m in ruled if self.rules[m].sleepers]
        asleep = self.store.asleep(sleepy) if sleepy else set()
        activity = self.store.activity() if sleepy else {}
        for m in self.asleep - asleep:
            self.awake_since[m] = now  # woken: its idle time starts again
        self.asleep = asleep
        for m in ruled:
            rules, state = self.rules[m], states[m]
            live = {ref: windows[ref].replicas for ref in self.pipelines[m]}
            layout = self._layout(now, m, state, live, whole_desired.get(m, 0)) if rules.layout else None
            idle = self._activity(now, m, state, desired[m], activity.get(m)) if rules.sleepers else None
            states[m] = replace(state, layout=layout, activity=idle, asleep=m in asleep)
        return states

    def _layout(self, now: float, model: str, state: PipelineState,
                live: dict[StageRef, tuple[ReplicaRecord, ...]], whole_desired: int) -> LayoutState:
        rule, stages = self.rules[model].layout, self.pipelines[model]
        arrivals = self.arrivals.setdefault(model, ArrivalWindows(rule.window_s, rule.windows))
        arrivals.add(now, self.records[stages[0]].new_starts)
        at_first = live[stages[0]]  # whole replicas register at the first stage too
        serving = tuple(sum(not x.draining and x.serves(ref) for x in live[ref]) for ref in stages)
        whole = sum(x.stage_end == stages[-1].last and not x.draining for x in at_first)
        busy = state.stages[0].queue_length + sum(x.sequences for x in at_first)
        return LayoutState(self.store.layout(model), arrivals.counts, arrivals.current, busy, whole_desired, whole,
                           serving)

    def _activity(self, now: float, model: str, state: PipelineState, desired: list[int],
                  seen: Activity | None) -> ModelActivity:
        """Idle since the gateway's latest request, or (behind a gateway that does not say) the
        latest request entering the model, or since this observer first saw it or saw it woken."""
        sleepers = self.rules[model].sleepers
        rows = self.records[self.pipelines[model][0]].rows
        last = max(self.awake_since.setdefault(model, now), rows[-1].arrived_at if rows else 0.0,
                   seen.last_request_at if seen else 0.0)
        work = (seen.in_flight if seen else 0) + sum(_work(state.stages[i]) for i in sleepers)
        return ModelActivity(last, self.rules[model].idle_s, sum(desired[i] for i in sleepers), work)


def _work(stage: StageState) -> int:
    return stage.queue_length + stage.in_flight
