"""The QUART policy: the corrector scales congested stages up, the smoother reclaims surplus
replicas elsewhere, and the compensator sizes CPUs where fewer replicas carry the traffic."""
from __future__ import annotations

from dataclasses import dataclass, field

from autoscaler.policy.compensator import Compensator
from autoscaler.policy.corrector import Corrector, CorrectorMemory
from autoscaler.policy.smoother import Smoother, predict_cvs
from autoscaler.policy.state import Decision, PipelineState


@dataclass(frozen=True)
class Quart:
    corrector: Corrector = field(default_factory=Corrector)
    smoother: Smoother = field(default_factory=Smoother)
    compensator: Compensator | None = None
    name: str = "quart"

    def decide(self, state: PipelineState, memory: CorrectorMemory | None = None) -> tuple[Decision, CorrectorMemory]:
        return self.decide_many([state], [memory])[0]

    def decide_many(self, states: list[PipelineState], memories: list[CorrectorMemory | None]
                    ) -> list[tuple[Decision, CorrectorMemory]]:
        """One tick for many pipelines: the same as `decide` on each, with the CV prediction batched."""
        all_cvs = predict_cvs(self.smoother.model, states)
        return [self.decide_with_cvs(s, m, cvs) for s, m, cvs in zip(states, memories, all_cvs)]

    def decide_with_cvs(self, state: PipelineState, memory: CorrectorMemory | None,
                        cvs: list[float]) -> tuple[Decision, CorrectorMemory]:
        """`decide` with the stages' predicted CVs computed by the caller (batched)."""
        decision, memory = self.corrector.decide(state, memory)
        settled = [m.below_ticks >= self.corrector.config.down_ticks for m in memory.stages]
        decision = self.smoother.smooth(state, decision, cvs, settled)
        if self.compensator is not None:
            decision = self.compensator.allocate(state, decision)
        return Decision(decision.model, self.name, decision.stages), memory
