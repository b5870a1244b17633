"""The QUART policy: the corrector scales congested stages up, the smoother reclaims surplus
replicas elsewhere, and the compensator sizes CPUs where fewer replicas carry the traffic."""
from __future__ import annotations

from dataclasses import dataclass, field

from autoscaler.compensator import Compensator
from autoscaler.corrector import Corrector, CorrectorMemory
from autoscaler.smoother import Smoother
from autoscaler.state import Decision, PipelineState


@dataclass(frozen=True)
class Quart:
    corrector: Corrector = field(default_factory=Corrector)
    smoother: Smoother = field(default_factory=Smoother)
    compensator: Compensator | None = None
    name: str = "quart"

    def decide(self, state: PipelineState, memory: CorrectorMemory | None = None) -> tuple[Decision, CorrectorMemory]:
        decision, memory = self.corrector.decide(state, memory)
        decision = self.smoother.smooth(state, decision)
        if self.compensator is not None:
            decision = self.compensator.allocate(state, decision)
        return Decision(decision.model, self.name, decision.stages), memory
