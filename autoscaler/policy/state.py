"""What a scaling policy sees and what it decides. Plain values: a policy is a pure function
from (observed state, its own memory) to (decision, new memory), with no I/O, so the live loop,
the simulator and the tests drive the same code."""
from __future__ import annotations

from dataclasses import dataclass, field

from autoscaler.policy.idle import ModelActivity
from autoscaler.policy.layout import LayoutState
from contracts.config import Bounds
from contracts.stage_graph import chain
from scheduler.wake_layout import WakeChoice


@dataclass(frozen=True, slots=True)
class StageState:
    """One stage over the last observation window."""
    stage: int
    arrival_rate: float          # λ, work items per second
    service_time_s: float        # mean compute time of one item on one replica (1/μ)
    replicas: int
    arrival_cv: float = 1.0      # coefficient of variation of inter-arrival times
    service_cv: float = 1.0      # coefficient of variation of service times
    cpus: float = 1.0            # CPUs per replica
    queue_length: int = 0        # items waiting, not yet taken by a replica
    in_flight: int = 0           # items being computed
    wait_s: float = 0.0          # measured mean queue wait
    latency_s: float = 0.0       # measured mean sojourn (wait + service)
    payload: float = 0.0         # mean payload per item (tokens), for the CPU compensator
    ready_replicas: int | None = None  # registered and serving; None: all of `replicas`
    # The highest arrival rate over any PEAK_S seconds of the window (the traffic envelope's
    # finest time scale, autoscaler.policy.window); 0 where not observed.
    peak_rate: float = 0.0
    # The share of the window its ready replicas spent computing (QUART Fig. 3a's utilisation):
    # finished items' service time over window × replicas.
    busy_fraction: float = 0.0

    @property
    def scaling_up(self) -> bool:
        """Replicas asked for are still starting."""
        return self.ready_replicas is not None and self.ready_replicas < self.replicas

    @property
    def service_rate(self) -> float:
        return 1.0 / self.service_time_s if self.service_time_s > 0 else float("inf")

    @property
    def concurrency(self) -> int:
        """Items in the stage: what Knative and Ray Serve scale on."""
        return self.queue_length + self.in_flight


@dataclass(frozen=True)
class PipelineState:
    model: str
    stages: tuple[StageState, ...]
    slo_s: float                 # end-to-end latency objective
    entry_rate: float            # requests per second arriving at the model
    now: float = 0.0             # seconds; policies with windows use it
    # Edges (from, to) of the stage graph, each from a lower stage index to a higher one (the
    # stages' order is a topological order); None means a chain 0 -> 1 -> ... -> S-1.
    edges: tuple[tuple[int, int], ...] | None = None
    # Replicas a stage may have: policies may read them (the PID's anti-windup, the smoother's
    # floor); the controller applies them to every decision, once.
    bounds: Bounds = field(default_factory=Bounds)
    # Cores idle on the host(s) the model's replicas compute on; None where that does not bound
    # them (emulated compute) or is not measured.
    cpu_free: float | None = None
    # What the model-level rules beside the policy read (autoscaler/policy/arbitration.py): its
    # layout, where it has a whole-model function; its activity, where stage functions may scale
    # to zero; and whether they are asleep now.
    layout: LayoutState | None = None
    activity: ModelActivity | None = None
    asleep: bool = False
    # Asleep with work waiting and a whole-model function: the layout Algorithm 1 chose for it to
    # wake in (None: no view of the servers; it wakes as its stage functions).
    wake: WakeChoice | None = None

    def graph(self) -> tuple[tuple[int, int], ...]:
        if self.edges is not None:
            return self.edges
        return chain(len(self.stages))

    def path_lengths(self, weights: list[float]) -> list[float]:
        """Per stage, the heaviest source-to-sink path through it, by `weights` per stage (a
        chain: the total)."""
        n = len(self.stages)
        if self.edges is None:  # a chain: one path through every stage
            return [sum(weights)] * n
        before, after = list(weights), list(weights)
        for a, b in sorted(self.graph()):
            before[b] = max(before[b], before[a] + weights[b])
        for a, b in sorted(self.graph(), reverse=True):
            after[a] = max(after[a], after[b] + weights[a])
        return [before[i] + after[i] - weights[i] for i in range(n)]


@dataclass(slots=True)
class StageDecision:
    stage: int
    replicas: int
    cpus: float
    key: bool = False
    # Why: the figures the decision came from (λ, μ, predicted delay, PID terms, ...).
    reason: dict = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class Decision:
    model: str
    policy: str
    stages: tuple[StageDecision, ...]

    @classmethod
    def of(cls, state: PipelineState, policy: str, replicas: list[int], reasons: list[dict]) -> Decision:
        """A decision of replica counts only: CPUs as they are, no key stages."""
        return cls(state.model, policy, tuple(StageDecision(s.stage, r, s.cpus, False, why)
                                              for s, r, why in zip(state.stages, replicas, reasons)))

    @property
    def key_stages(self) -> tuple[int, ...]:
        return tuple(s.stage for s in self.stages if s.key)

    def replicas(self) -> list[int]:
        return [s.replicas for s in self.stages]

    def bounded(self, bounds: Bounds) -> Decision:
        """The decision with every stage's replicas within `bounds`; the clamp noted in its reason."""
        out = []
        for d in self.stages:
            n = bounds.clamp(d.replicas)
            out.append(d if n == d.replicas else
                       StageDecision(d.stage, n, d.cpus, d.key, {**d.reason, "bounded_from": d.replicas}))
        return Decision(self.model, self.policy, tuple(out))
