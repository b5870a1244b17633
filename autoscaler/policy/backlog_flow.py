"""A refinement of QUART's corrector for bursts (the `quart-flow` variant), from what the
simulator's decision logs show: under bursty arrivals (entry CV 4-8) the paper's corrector lets a
burst queue at each stage in turn. Its PID sees a stage's delay only once the burst has reached
it, adds at most `max_up` replicas a tick, and the smoother meanwhile reclaims the stages the
burst has not reached yet, whose windows look calm; and a burst that comes back finds the
replicas of the last one reclaimed.

The backlog is known at once, though, and where it will go: every item queued at stage k passes
through every stage after it in the graph. So each stage is sized for the traffic it is about to carry: its own
arrival rate, its traffic envelope (the busiest second of the window), or the backlog queued at
it and before it drained within `horizon_s`, whichever is highest; and that size is held for
`hold_s`, since bursts recur. A stage sized up this way is marked key, so the KeysManagers cache
it and its replicas fork. Pure: state and memory in, decision and memory out."""
from __future__ import annotations

import math
from dataclasses import dataclass

from autoscaler.policy.state import Decision, PipelineState, StageDecision

# Per stage: (replicas the flow asked for, when it last asked for at least that many).
FlowMemory = tuple[tuple[int, float], ...]


def backlog_upstream(state: PipelineState) -> list[int]:
    """Per stage, the requests queued or in service at it or before it: every one of them will
    pass it. Past a join, a request's parts wait in each branch: it counts once, by its branch
    with the most."""
    up = [s.queue_length + s.in_flight for s in state.stages]
    before: dict[int, int] = {}
    for a, b in sorted(state.graph()):
        before[b] = max(before.get(b, 0), up[a])
        # Edges sorted by their source: every edge into b comes before any edge out of b.
        up[b] = state.stages[b].queue_length + state.stages[b].in_flight + before[b]
    return up


@dataclass(frozen=True)
class BacklogFlow:
    horizon_s: float = 1.0            # drain what is queued up to a stage within this
    target_utilization: float = 0.9
    hold_s: float = 60.0              # keep a burst's size this long after it was last needed
    # Headroom while traffic is calm: while the entry's arrival CV is at most calm_cv, size for this
    # utilization instead (None: target_utilization always). Lower utilization everywhere would
    # fill a cluster during bursts, when the replicas are wanted at the burst's stages.
    calm_utilization: float | None = None
    calm_cv: float = 4.0

    def __post_init__(self) -> None:
        calm = self.target_utilization if self.calm_utilization is None else self.calm_utilization
        if not (self.horizon_s > 0 and 0 < self.target_utilization <= 1 and 0 < calm <= 1
                and self.hold_s >= 0 and self.calm_cv >= 0):
            raise ValueError("quart-flow needs horizon_s > 0, target_utilization and calm_utilization in (0, 1], "
                             f"hold_s >= 0 and calm_cv >= 0, not {self}")

    def utilization(self, state: PipelineState) -> float:
        calm = self.calm_utilization is not None and state.stages[0].arrival_cv <= self.calm_cv
        return self.calm_utilization if calm else self.target_utilization

    def apply(self, state: PipelineState, decision: Decision,
              memory: FlowMemory = ()) -> tuple[Decision, FlowMemory]:
        held = memory if len(memory) == len(state.stages) else ((0, -math.inf),) * len(state.stages)
        out, new_memory, utilization = [], [], self.utilization(state)
        for s, d, (last_need, since), upstream in zip(state.stages, decision.stages, held, backlog_upstream(state)):
            rate = max(s.arrival_rate, s.peak_rate, upstream / self.horizon_s)
            need = state.bounds.clamp(math.ceil(rate * s.service_time_s / utilization))
            if need >= last_need or state.now - since > self.hold_s:
                last_need, since = need, state.now
            new_memory.append((last_need, since))
            if last_need <= d.replicas:
                out.append(d)
                continue
            out.append(StageDecision(d.stage, last_need, d.cpus, True,
                                     {**d.reason, "flow_rps": rate, "backlog_upstream": upstream, "flow_need": last_need}))
        return Decision(decision.model, decision.policy, tuple(out)), tuple(new_memory)
