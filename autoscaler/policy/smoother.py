"""QUART's smoother (§5.2): predict each stage's arrival CV with a CV-propagation attention model
over the pipeline graph (Eq. 4–6), then reclaim replicas where bursts have been smoothed out,
blending each stage's need with its neighbours' (Eq. 7). It never adds replicas.

Eq. 4 as printed adds θ·CV_i to every logit of node i's softmax, where it cancels out (a softmax
does not change when the same constant is added to all its inputs), so θ could never be learned.
The term here is θ·CV_j, the neighbour's observed CV: how bursty each upstream stage is decides
how much attention its features get.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from autoscaler.policy.corrector import stage_targets
from autoscaler.policy.queueing import min_servers
from autoscaler.policy.state import Decision, PipelineState, StageDecision, StageState

FEATURES = 5


def stage_features(s: StageState) -> list[float]:
    """What the attention model sees of a stage: how bursty its arrivals are, and what its
    service does to them (utilisation per replica, service CV, replicas, rate)."""
    utilisation = s.arrival_rate * s.service_time_s / max(1, s.replicas)
    return [s.arrival_cv, min(utilisation, 2.0), s.service_cv, math.log1p(s.replicas), math.log1p(s.arrival_rate)]


def predecessors(num_stages: int, edges: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """mask[i, j]: stage j feeds stage i. A stage's own arrivals are what is predicted, so its
    own observations are not among its inputs."""
    mask = torch.zeros(num_stages, num_stages, dtype=torch.bool)
    for a, b in edges:
        mask[b, a] = True
    return mask


class CVAttention(nn.Module):
    """One graph-attention layer (Eq. 4–5) and a head that reads the CV off it (Eq. 6).
    A stage without predecessors (the entry stage) keeps its observed CV."""

    def __init__(self, features: int = FEATURES, hidden: int = 16) -> None:
        super().__init__()
        self.w = nn.Linear(features, hidden, bias=False)
        self.a = nn.Linear(2 * hidden, 1, bias=False)
        self.theta = nn.Parameter(torch.zeros(()))
        self.head = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x: [..., N, F] stage features (feature 0 the observed CV), mask: [N, N] -> [..., N] CV.
        Leading dimensions batch pipelines of the same graph."""
        h = self.w(x)
        n = h.shape[-2]
        rows = h.unsqueeze(-2).expand(*h.shape[:-2], n, n, h.shape[-1])   # [..., i, j, H] = h_i
        cols = h.unsqueeze(-3).expand(*h.shape[:-2], n, n, h.shape[-1])   # [..., i, j, H] = h_j
        logits = nn.functional.leaky_relu(self.a(torch.cat([rows, cols], dim=-1)).squeeze(-1), 0.2)
        logits = logits + self.theta * x[..., 0].unsqueeze(-2)
        has_pred = mask.any(dim=1)
        alpha = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)
        alpha = torch.where(has_pred.unsqueeze(1), alpha, torch.zeros_like(alpha))
        predicted = nn.functional.softplus(self.head(alpha @ h).squeeze(-1))
        return torch.where(has_pred, predicted, x[..., 0])

    def save(self, path: Path) -> None:
        torch.save({"state": self.state_dict(), "hidden": self.w.out_features}, path)

    @classmethod
    def load(cls, path: Path) -> CVAttention:
        data = torch.load(path, weights_only=True)  # tensors only: nothing here runs code
        model = cls(hidden=data["hidden"])
        model.load_state_dict(data["state"])
        return model.eval()


@dataclass(frozen=True)
class CVForecast:
    """Each stage's arrival CV, predicted by one CV-attention model (equal for the same model:
    nn.Module compares by identity), so that every model sharing it is predicted in one pass."""
    model: CVAttention | None

    def predict(self, states: list[PipelineState]) -> list[list[float]]:
        return predict_cvs(self.model, states)


def predict_cvs(model: CVAttention | None, states: list[PipelineState]) -> list[list[float]]:
    """Each stage's predicted arrival CV, for many pipelines at once (one batched forward per
    graph shape); without a trained model, the observed CVs."""
    out = [[s.arrival_cv for s in state.stages] for state in states]
    if model is None:
        return out
    groups: dict[tuple, list[int]] = {}
    for k, state in enumerate(states):
        groups.setdefault((len(state.stages), state.graph()), []).append(k)
    for (n, edges), members in groups.items():
        x = torch.tensor([[stage_features(s) for s in states[k].stages] for k in members], dtype=torch.float32)
        with torch.no_grad():
            predicted = model(x, predecessors(n, edges)).tolist()
        for k, cvs in zip(members, predicted):
            out[k] = cvs
    return out


def neighbours(num_stages: int, edges: tuple[tuple[int, int], ...]) -> list[list[int]]:
    """N(i) of Eq. 7: the stages next to i in the graph, either way."""
    n: list[list[int]] = [[] for _ in range(num_stages)]
    for a, b in edges:
        n[a].append(b)
        n[b].append(a)
    return n


def beta(cv: float) -> float:
    """Eq. 7's weight of a stage's own need: near 1 for bursty stages (keep their buffer), lower
    where traffic is smooth (share the neighbours' lower need)."""
    return cv * cv / (1.0 + cv * cv)


@dataclass(frozen=True)
class Smoother:
    model: CVAttention | None = field(default=None, compare=False)
    name: str = "quart-smoother"

    def forecast(self) -> CVForecast:
        return CVForecast(self.model)

    def smooth(self, state: PipelineState, proposed: Decision, cvs: list[float] | None = None,
               settled: list[bool] | None = None) -> Decision:
        """Reclaims replicas from `proposed` (the corrector's decision); never adds any.
        `cvs`: the predicted CVs where the caller batched the prediction. `settled`: per stage,
        whether its burst has been over long enough to reclaim (the corrector's scale-down
        hysteresis); without it every non-key stage may be reclaimed."""
        cvs = predict_cvs(self.model, [state])[0] if cvs is None else cvs
        targets = stage_targets(state)
        needs: dict[int, int] = {}

        def need(i: int) -> int:
            """The fewest replicas meeting stage i's target at its predicted CV (computed once)."""
            if i not in needs:
                s = state.stages[i]
                budget = max(1e-6, targets[i] - s.service_time_s)
                needs[i] = min_servers(s.arrival_rate, s.service_rate, budget, cvs[i] * cvs[i], s.service_cv ** 2)
            return needs[i]
        groups = neighbours(len(state.stages), state.graph())
        out = []
        for i, (s, d) in enumerate(zip(state.stages, proposed.stages)):
            if d.key or (settled is not None and not settled[i]):
                # A key stage is still congested, and one just out of a burst may be hit again:
                # what the corrector gave them stays, so that replicas do not flap.
                out.append(d)
                continue
            others = [need(j) for j in groups[i]] or [need(i)]
            blended = beta(cvs[i]) * need(i) + (1 - beta(cvs[i])) * sum(others) / len(others)
            floor = max(state.bounds.r_min, math.floor(s.arrival_rate * s.service_time_s) + 1 if s.arrival_rate else 0)
            replicas = min(d.replicas, max(floor, math.ceil(blended)))
            reason = {**d.reason, "predicted_cv": cvs[i], "need": need(i), "smoothed": replicas}
            out.append(StageDecision(d.stage, replicas, d.cpus, d.key, reason))
        return Decision(proposed.model, proposed.policy, tuple(out))
