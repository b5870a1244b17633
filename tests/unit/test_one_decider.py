"""The one decider of replica counts: the arbitration between the autoscaling policy and the layout
and idle rules (autoscaler/policy/arbitration.py), table-driven with explicit time as Knative's
scaling tests are, and the `Controller` with both rules on the in-memory store: the Observer reads
what the store holds, the step decides, `enact` carries it out into the store, and replicas come
up as asked. A scale-to-zero cycle, a consolidation cycle, and a consolidated model put to sleep
and woken, tick by tick."""
from __future__ import annotations

import logging

import pytest

from autoscaler.observe import Observer
from autoscaler.policy.arbitration import HOLD, POLICY, ModelRules, Ruling, rule
from autoscaler.policy.baselines import Static
from autoscaler.policy.controller import Actions, Controller, enact
from autoscaler.policy.idle import ModelActivity
from autoscaler.policy.layout import LayoutDecision, LayoutRule, LayoutState
from autoscaler.policy.state import PipelineState, StageState
from contracts.stage import StageRef
from scheduler.coldstart import ColdStartPlan
from scheduler.wake_layout import WakeChoice
from state.memory import MemoryStore
from state.records import CONSOLIDATING, PIPELINED, SPLITTING, WHOLE, Activity, Backlog, LayoutChange, ReplicaRecord, StageSample

REFS = (StageRef("m", 0, 1), StageRef("m", 1, 2))
LAYOUT = LayoutRule(windows=2, per_replica=4, max_whole=1, window_s=2.0)


def pipeline(now: float = 100.0, layout: LayoutState | None = None, activity: ModelActivity | None = None,
             asleep: bool = False, wake: WakeChoice | None = None) -> PipelineState:
    stages = tuple(StageState(stage=i, arrival_rate=1.0, service_time_s=0.05, replicas=1) for i in range(2))
    return PipelineState("m", stages, slo_s=2.0, entry_rate=1.0, now=now, layout=layout, activity=activity,
                         asleep=asleep, wake=wake)


def chosen(whole: bool) -> WakeChoice:
    """Algorithm 1's choice for a wake (scheduler/wake_layout.py), as the live loop gives it."""
    return WakeChoice(whole, ColdStartPlan(1 if whole else 2, 1 if whole else 2, ("n0",), 1.0, 0.1, 1.0), {}, "why")


def idle_for(seconds: float, replicas: int = 2, work: int = 0) -> ModelActivity:
    return ModelActivity(last_request_at=100.0 - seconds, idle_s=10.0, replicas=replicas, work=work)


def laid(layout: str, counts=(0, 0), current: int = 0, desired: int = 0, whole: int = 0, stages=(1, 1)) -> LayoutState:
    return LayoutState(layout, counts, current, 0, desired, whole, stages)


SLEEPY = ModelRules(sleepers=(0, 1), wake_to=1, idle_s=10.0)
BOTH = ModelRules(LAYOUT, sleepers=(0, 1), wake_to=1, idle_s=10.0)


@pytest.mark.parametrize("name,rules,state,want", [
    ("no rules: the policy's", ModelRules(), pipeline(), POLICY),
    ("busy lately: the policy's", SLEEPY, pipeline(activity=idle_for(3)), POLICY),
    ("idle long enough: asleep", SLEEPY, pipeline(activity=idle_for(11)), Ruling(False, ((0, 0), (1, 0)), asleep=True)),
    ("idle, but a request in flight: the policy's", SLEEPY, pipeline(activity=idle_for(11, work=1)), POLICY),
    ("asleep, nothing waits: held at zero", SLEEPY, pipeline(activity=idle_for(60, replicas=0), asleep=True), HOLD),
    ("asleep, work waits: woken", SLEEPY, pipeline(activity=idle_for(60, replicas=0, work=2), asleep=True),
     Ruling(False, ((0, 1), (1, 1)), asleep=False)),
    ("asleep, work waits, whole chosen for the wake: the whole function woken", BOTH,
     pipeline(activity=idle_for(60, replicas=0, work=2), asleep=True, wake=chosen(whole=True)),
     Ruling(False, (), 1, LayoutDecision(WHOLE, "why", whole=1), asleep=False)),
    ("asleep, work waits, stages chosen for the wake: woken, the choice recorded", BOTH,
     pipeline(activity=idle_for(60, replicas=0, work=2), asleep=True, wake=chosen(whole=False)),
     Ruling(False, ((0, 1), (1, 1)), layout=LayoutDecision(PIPELINED, "why"), asleep=False)),
    ("asleep, scaled up by hand: awake again", SLEEPY, pipeline(activity=idle_for(60, replicas=2), asleep=True),
     Ruling(False, asleep=False)),
    ("pipelined, still warming: the policy's", BOTH, pipeline(layout=laid(PIPELINED, counts=(0,)), activity=idle_for(3)),
     POLICY),
    ("pipelined and quiet: consolidating beside the policy", BOTH, pipeline(layout=laid(PIPELINED), activity=idle_for(3)),
     Ruling(True, whole=1, layout=LayoutDecision(CONSOLIDATING, "consolidate: 1 whole replica(s) needed of 1 allowed", whole=1))),
    ("consolidating, whole replica up: whole, the stages to zero", BOTH,
     pipeline(layout=laid(CONSOLIDATING, desired=1, whole=1), activity=idle_for(3)),
     Ruling(False, ((0, 0), (1, 0)), None, LayoutDecision(WHOLE, "whole replicas serving: the stages hand their caches over", stages=0))),
    ("whole and steady, busy lately: held", BOTH,
     pipeline(layout=laid(WHOLE, desired=1, whole=1, stages=(0, 0)), activity=idle_for(3, replicas=0)), HOLD),
    ("whole and steady, idle long enough: asleep, to wake as its stage functions", BOTH,
     pipeline(layout=laid(WHOLE, desired=1, whole=1, stages=(0, 0)), activity=idle_for(60, replicas=0)),
     Ruling(False, ((0, 0), (1, 0)), 0, LayoutDecision(PIPELINED, "asleep: its layout is chosen as it wakes", whole=0),
            asleep=True)),
    ("whole, idle, but a request in flight: held", BOTH,
     pipeline(layout=laid(WHOLE, desired=1, whole=1, stages=(0, 0)), activity=idle_for(60, replicas=0, work=1)), HOLD),
    ("whole and idle, no stage labelled to sleep: held", ModelRules(LAYOUT),
     pipeline(layout=laid(WHOLE, desired=1, whole=1, stages=(0, 0)), activity=idle_for(60, replicas=0)), HOLD),
    ("whole, a burst: splitting, the stages back", BOTH,
     pipeline(layout=laid(WHOLE, current=9, desired=1, whole=1, stages=(0, 0)), activity=idle_for(1)),
     Ruling(False, ((0, 1), (1, 1)), None, LayoutDecision(SPLITTING, "split: 3 whole replica(s) needed of 1 allowed", stages=1))),
    ("consolidating, idle: not put to sleep mid-way", BOTH,
     pipeline(layout=laid(CONSOLIDATING, desired=1, whole=0), activity=idle_for(60)), POLICY),
])
def test_the_arbitration(name, rules, state, want):
    assert rule(state, rules) == want


class World:
    """The mechanism over the memory store: replica counts asked for, and replicas that register
    as soon as they are asked for (and leave as soon as they are not)."""

    def __init__(self, store: MemoryStore) -> None:
        self.store = store
        self.desired = {ref: 1 for ref in REFS}
        self.whole = 0

    def publish_key_stages(self, model, stages):
        self.store.publish_key_stages(model, stages)

    def set_replicas(self, stage, replicas):
        self.desired[stage] = replicas

    def set_cpus(self, stage, cpus):
        pass

    def set_whole(self, model, replicas):
        self.whole = replicas

    def set_layout(self, model, change):
        self.store.set_layout(model, LayoutChange(self.store.clock(), change.layout, change.reason), 100)

    def set_asleep(self, model, asleep):
        if asleep:
            self.store.set_asleep(model, self.store.clock())
        else:
            self.store.wake(model, self.store.clock(), 30.0)

    def sync(self) -> None:
        wanted = [(ref, f"m-s{ref.stages}.{k}", ref.first, ref.last) for ref in REFS for k in range(self.desired[ref])]
        wanted += [(None, f"m-whole.{k}", 0, 2) for k in range(self.whole)]
        for _, rid, first, last in wanted:
            self.store.register(ReplicaRecord(rid, "m", first, last, "here", 1), ttl_s=1e9)
        keep = {rid for _, rid, _, _ in wanted}
        for stage in (0, 1):
            for rec in self.store.live_replicas("m", stage):
                if rec.replica_id not in keep:
                    self.store.deregister(rec)


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def harness(rules: ModelRules, replicas: int = 2):
    clock = Clock()
    store = MemoryStore(clock=clock)
    world = World(store)
    controller = Controller({"m": REFS}, {"m": Static(replicas)}, rules={"m": rules})
    observer = Observer(store, {"m": REFS}, window_s=10.0, rules={"m": rules})

    def tick(t: float) -> list[Actions]:
        clock.now = t
        world.sync()
        observed = observer.observe(t, {"m": [world.desired[ref] for ref in REFS]}, 2.0, {"m": world.whole})
        steps = controller.step(t, observed)
        for actions in steps:
            assert enact(world, actions, logging.getLogger("test")) == []
        return steps
    return clock, store, world, tick


def request(store: MemoryStore, clock: Clock, t: float, n: int = 1) -> None:
    clock.now = t
    for k in range(n):
        store.add_sample("m", 0, StageSample(f"r{t}.{k}", t, 1.0, 20.0, "m-s0.0", "prefill"), maxlen=1000)


def test_a_scale_to_zero_cycle_tick_by_tick():
    clock, store, world, tick = harness(SLEEPY)
    assert [a.decision.policy for a in tick(0.0)] == ["static"]          # the policy sizes the stages
    assert world.desired == {REFS[0]: 2, REFS[1]: 2}
    request(store, clock, 1.0)
    tick(5.0)
    store.set_activity({"m": Activity(6.0, in_flight=1)})                 # the gateway answers a long generation
    tick(15.0)
    assert world.desired == {REFS[0]: 2, REFS[1]: 2} and not store.asleep(["m"])
    store.set_activity({"m": Activity(16.0, in_flight=0)})                # answered at 16: idle from then
    tick(20.0)
    assert world.desired == {REFS[0]: 2, REFS[1]: 2}
    [asleep] = tick(26.5)                                                 # 10.5 s idle, nothing waits
    assert asleep.asleep is True and asleep.decision is None
    assert world.desired == {REFS[0]: 0, REFS[1]: 0} and store.asleep(["m"]) == {"m"}
    assert tick(30.0) == [] and tick(60.0) == []                          # left at zero: no policy runs
    store.set_backlog("m", 0, Backlog(waiting=1, arrivals=(61.0,)))       # work reached the entry some other way
    [woken] = tick(61.5)
    assert woken.asleep is False and world.desired == {REFS[0]: 1, REFS[1]: 1}
    assert not store.asleep(["m"]) and store.waking("m")
    store.set_backlog("m", 0, Backlog())
    assert [a.decision.policy for a in tick(62.0)] == ["static"] and world.desired == {REFS[0]: 2, REFS[1]: 2}


def test_a_consolidation_cycle_tick_by_tick():
    clock, store, world, tick = harness(ModelRules(LAYOUT), replicas=1)
    tick(0.0)                                                             # the first look starts the windows
    tick(2.0)
    assert store.layout("m") == PIPELINED and world.whole == 0            # one window seen of two
    [consolidate] = tick(4.0)                                             # two quiet windows: one whole replica fits
    assert consolidate.decision is not None and consolidate.whole == 1 and world.whole == 1
    assert store.layout("m") == CONSOLIDATING
    [whole] = tick(5.0)                                                   # the whole replica serves: stages go
    assert whole.decision is None and world.desired == {REFS[0]: 0, REFS[1]: 0} and store.layout("m") == WHOLE
    assert tick(6.0) == []                                                # whole and steady: nothing to do
    request(store, clock, 6.5, n=9)                                       # a burst the one whole replica cannot take
    [split] = tick(7.0)
    assert split.layout.layout == SPLITTING and world.desired == {REFS[0]: 1, REFS[1]: 1}
    [back] = tick(8.0)                                                    # the stages serve: the whole replica goes
    assert back.layout.layout == PIPELINED and back.whole == 0 and back.decision is not None and world.whole == 0
    assert [c.layout for c in store.layout_changes("m")] == [CONSOLIDATING, WHOLE, SPLITTING, PIPELINED]


def test_a_model_served_whole_sleeps_when_idle_and_wakes_as_its_stage_functions():
    clock, store, world, tick = harness(BOTH, replicas=1)
    tick(0.0)
    store.set_activity({"m": Activity(0.5, in_flight=0)})
    tick(2.0)
    tick(4.0)                                                             # two quiet windows: consolidating
    tick(5.0)
    assert store.layout("m") == WHOLE and world.whole == 1 and world.desired == {REFS[0]: 0, REFS[1]: 0}
    assert tick(8.0) == []                                                # whole, idle 7.5 s of 10: held
    [asleep] = tick(11.0)                                                 # idle 10.5 s: asleep
    assert asleep.asleep is True and asleep.whole == 0 and world.whole == 0
    assert store.layout("m") == PIPELINED and store.asleep(["m"]) == {"m"}
    assert world.desired == {REFS[0]: 0, REFS[1]: 0}
    assert tick(30.0) == []                                               # left at zero
    store.set_backlog("m", 0, Backlog(waiting=1, arrivals=(31.0,)))       # work waits: the stages wake
    [woken] = tick(31.5)
    assert woken.asleep is False and world.desired == {REFS[0]: 1, REFS[1]: 1} and world.whole == 0
