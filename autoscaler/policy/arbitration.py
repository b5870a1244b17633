"""Who sets a model's replica counts this tick: the one arbitration rule between the autoscaling
policy and the two model-level rules, layout (autoscaler/policy/layout.py: consolidate into the
whole-model function, split back) and idling (autoscaler/policy/idle.py: scale to zero and back).
Pure: the observed state in, a ruling out; the `Controller` runs it for every model before the
policy and carries the ruling out with the policy's decision, through `enact`.

In order:
1. A model asleep (its labelled stage functions put to zero for idleness) is the idle rule's: it
   wakes them when work waits in their streams (or its whole-model function, where the layout
   chosen for the wake, Algorithm 1's, is whole), and is otherwise left at zero. (A request on its
   way in wakes them at the gateway, OpenFaaS's scale from zero; that clears the mark.)
2. A model whose layout is, or goes, whole or splitting is the layout rule's: the whole-model
   function serves it, and the stage functions are set by the layout alone. Served whole and
   idle for its zero-duration, it is put to sleep: its whole replicas go and its layout is
   recorded pipelined; the gateway's wake chooses its layout (runtime/activator.py), this rule's
   wake (1.) its stage functions.
3. A pipelined model idle for its zero-duration is put to sleep.
4. Otherwise the autoscaling policy sets the stage functions; the layout rule may set the whole
   function beside them (consolidating starts it; staying pipelined keeps it at zero)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from autoscaler.policy import idle
from autoscaler.policy import layout as layouts
from autoscaler.policy.layout import LayoutDecision, LayoutRule
from autoscaler.policy.state import PipelineState
from state.records import PIPELINED, SPLITTING, WHOLE


@dataclass(frozen=True)
class ModelRules:
    """A model's rules beside its policy."""
    layout: LayoutRule | None = None   # None: no whole-model function to consolidate into
    sleepers: tuple[int, ...] = ()     # its stage functions (by index) labelled to scale to zero
    wake_to: int = 1                   # replicas each sleeper wakes to
    idle_s: float = 0.0                # how long the model must be idle before they sleep


@dataclass(frozen=True)
class Ruling:
    policy: bool                                  # the autoscaling policy sets the stage functions
    replicas: tuple[tuple[int, int], ...] = ()    # stage function index -> replicas the rules set
    whole: int | None = None                      # replicas for the whole function; None: leave it
    layout: LayoutDecision | None = None          # a change of layout, to record
    asleep: bool | None = None                    # True: put to sleep; False: woken; None: as it is


POLICY = Ruling(True)
HOLD = Ruling(False)


def rule(state: PipelineState, rules: ModelRules) -> Ruling:
    if state.asleep:
        return _asleep(state, rules)
    change = layouts.decide(state.layout, rules.layout) if rules.layout and state.layout else None
    current = change.layout if change else state.layout.layout if state.layout else PIPELINED
    if current in (WHOLE, SPLITTING):
        if change is None:
            return _sleep_whole(state, rules) if current == WHOLE else HOLD
        stages = () if change.stages is None else tuple((i, change.stages) for i in range(len(state.stages)))
        return Ruling(False, stages, change.whole, change)
    whole = change.whole if change else None
    if current == PIPELINED and _idle(state, rules):
        return Ruling(False, tuple((i, 0) for i in rules.sleepers), whole, change, asleep=True)
    return Ruling(True, (), whole, change)


def _sleep_whole(state: PipelineState, rules: ModelRules) -> Ruling:
    """A model served whole goes to sleep as a pipelined one does, once idle; its replicas are the
    whole function's (its stage functions are at zero for the layout)."""
    if state.layout is None or not _idle(state, rules, state.layout.whole_desired):
        return HOLD
    return Ruling(False, tuple((i, 0) for i in rules.sleepers), 0,
                  LayoutDecision(PIPELINED, "asleep: its layout is chosen as it wakes", whole=0), asleep=True)


def _idle(state: PipelineState, rules: ModelRules, replicas: int | None = None) -> bool:
    """Whether the idle rule puts the model to sleep now: it has stage functions labelled to, and
    has been idle for their zero-duration holding no work; `replicas` counts what it holds where
    the stage functions' replicas do not (a model served whole)."""
    if not rules.sleepers or state.activity is None:
        return False
    activity = state.activity if replicas is None else replace(state.activity, replicas=replicas)
    return idle.decide(state.now, activity) == "sleep"


def _asleep(state: PipelineState, rules: ModelRules) -> Ruling:
    activity = state.activity
    if activity is None:
        return HOLD
    if idle.decide(state.now, activity) == "wake":
        return _wake(state, rules)
    if activity.replicas > 0:
        return Ruling(False, asleep=False)  # scaled up by hand: the autoscaler's again from the next tick
    return HOLD


def _wake(state: PipelineState, rules: ModelRules) -> Ruling:
    """Back from zero as its stage functions, or as its whole-model function where the layout
    chosen for the wake (state.wake) says so; a choice is recorded as a layout change."""
    choice = state.wake
    if choice is not None and choice.whole:
        return Ruling(False, (), 1, LayoutDecision(WHOLE, choice.reason, whole=1), asleep=False)
    stages = tuple((i, rules.wake_to) for i in rules.sleepers)
    return Ruling(False, stages, layout=None if choice is None else LayoutDecision(PIPELINED, choice.reason),
                  asleep=False)
