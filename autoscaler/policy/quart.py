"""The QUART policy: the corrector scales congested stages up, the smoother reclaims surplus
replicas elsewhere, and the compensator sizes CPUs where fewer replicas carry the traffic."""
from __future__ import annotations

from dataclasses import dataclass, field

from autoscaler.policy.backlog_flow import BacklogFlow, FlowMemory
from autoscaler.policy.compensator import Compensator
from autoscaler.policy.corrector import Corrector, CorrectorMemory
from autoscaler.policy.smoother import CVForecast, Smoother
from autoscaler.policy.state import Decision, PipelineState


@dataclass(frozen=True)
class QuartMemory:
    corrector: CorrectorMemory | None = None
    flow: FlowMemory = ()


@dataclass(frozen=True)
class Quart:
    corrector: Corrector = field(default_factory=Corrector)
    smoother: Smoother = field(default_factory=Smoother)
    compensator: Compensator | None = None
    flow: BacklogFlow | None = None     # the quart-flow variant's burst sizing; None: the paper's
    name: str = "quart"

    def forecast(self) -> CVForecast:
        return self.smoother.forecast()

    def decide(self, state: PipelineState, memory: QuartMemory | None = None,
               predicted: list[float] | None = None) -> tuple[Decision, QuartMemory]:
        """`predicted`: the stages' CVs where the caller batched the forecast over many models."""
        cvs = self.forecast().predict([state])[0] if predicted is None else predicted
        memory = memory or QuartMemory()
        decision, corrector = self.corrector.decide(state, memory.corrector)
        settled = [m.below_ticks >= self.corrector.config.down_ticks for m in corrector.stages]
        decision = self.smoother.smooth(state, decision, cvs, settled)
        flow = memory.flow
        if self.flow is not None:
            decision, flow = self.flow.apply(state, decision, flow)
        if self.compensator is not None:
            decision = self.compensator.allocate(state, decision)
        return Decision(decision.model, self.name, decision.stages), QuartMemory(corrector, flow)
