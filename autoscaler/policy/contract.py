"""What every autoscaling policy is to the `Controller`: state and its own memory in, a decision
and its next memory out. A policy that needs a prediction first (QUART's CV attention) names
a `Forecast`; the controller makes one forecast for every model whose policies name an equal
one (one batched forward pass), and hands each policy its part."""
from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Protocol

from autoscaler.policy.state import Decision, PipelineState


class Forecast(Hashable, Protocol):
    def predict(self, states: list[PipelineState]) -> list[Any]:
        """One prediction per state, made together."""
        ...


class Policy(Protocol):
    def forecast(self) -> Forecast | None:
        """What this policy needs predicted before it decides; None: it decides on what it observes."""
        ...

    def decide(self, state: PipelineState, memory: Any = None, predicted: Any = None) -> tuple[Decision, Any]:
        """This tick's decision and the memory the next tick gets; `predicted`: this state's part of
        the forecast (made here when None)."""
        ...


class Reactive:
    """A policy that decides on what it observes alone."""

    def forecast(self) -> None:
        return None
