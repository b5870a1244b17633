"""QUART's CPU compensator (§5.3, Algorithm 1 AllocateCPU): a linear regression of a stage's
service time on its CPUs and payload, fitted from a profile, gives each replica the fewest CPUs
whose predicted delay meets the stage's target, up to CPU_max; where even CPU_max misses it,
replicas are added back (the hand-back to the corrector)."""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from autoscaler.policy.corrector import stage_targets
from autoscaler.policy.queueing import allen_cunneen_wait, min_servers
from autoscaler.policy.state import Decision, PipelineState, StageDecision, StageState


@dataclass(frozen=True)
class CPUFit:
    """service time (s) ≈ b0 + b1 / cpus + b2 · payload + b3 · payload / cpus: the terms over
    cpus are the parallel part, which grows with the payload as the serial part does (a fit
    without b3 missed SmolLM2's measured profile by up to 89 %)."""
    b0: float
    b1: float
    b2: float
    b3: float = 0.0

    def predict(self, cpus: float, payload: float) -> float:
        return max(1e-6, self.b0 + self.b1 / cpus + self.b2 * payload + self.b3 * payload / cpus)


def fit_cpu_profile(samples: list[tuple[float, float, float]]) -> CPUFit:
    """Least squares over (cpus, payload, service seconds) samples."""
    a = np.array([[1.0, 1.0 / c, p, p / c] for c, p, _ in samples])
    y = np.array([s for _, _, s in samples])
    b0, b1, b2, b3 = np.linalg.lstsq(a, y, rcond=None)[0]
    return CPUFit(float(b0), float(b1), float(b2), float(b3))


def save_fits(fits: dict[int, CPUFit], path: Path) -> None:
    path.write_text(json.dumps({str(k): asdict(v) for k, v in fits.items()}, indent=1))


def load_fits(path: Path) -> dict[int, CPUFit]:
    return {int(k): CPUFit(**v) for k, v in json.loads(path.read_text()).items()}


def sojourn(s: StageState, service_s: float, replicas: int) -> float:
    wait = allen_cunneen_wait(s.arrival_rate, 1.0 / service_s, replicas, s.arrival_cv ** 2, s.service_cv ** 2)
    return wait + service_s if math.isfinite(wait) else math.inf


@dataclass(frozen=True)
class Compensator:
    fits: dict[int, CPUFit]
    cpu_max: int = 8

    def allocate(self, state: PipelineState, decision: Decision) -> Decision:
        targets = stage_targets(state)
        out = []
        for s, d, target in zip(state.stages, decision.stages, targets):
            fit = self.fits.get(s.stage)
            # Algorithm 1 compensates where replicas were reclaimed: fewer replicas carry the
            # stage's traffic, so each may need more CPUs.
            if fit is None or d.replicas >= s.replicas:
                out.append(d)
                continue
            cpus, replicas, met = self._cpus_for(s, fit, d.replicas, target, state.bounds.r_max)
            out.append(StageDecision(d.stage, replicas, float(cpus), d.key, {
                **d.reason, "cpus": cpus, "cpu_delay_s": sojourn(s, fit.predict(cpus, s.payload), replicas),
                "cpu_target_met": met}))
        return Decision(decision.model, decision.policy, tuple(out))

    def _cpus_for(self, s: StageState, fit: CPUFit, replicas: int, target: float, r_max: int) -> tuple[int, int, bool]:
        # More CPUs never slow a stage down on the fit, so the fewest that meet the target is
        # found by bisection.
        if sojourn(s, fit.predict(self.cpu_max, s.payload), replicas) <= target:
            low, high = 1, self.cpu_max
            while low < high:
                mid = (low + high) // 2
                if sojourn(s, fit.predict(mid, s.payload), replicas) <= target:
                    high = mid
                else:
                    low = mid + 1
            return low, replicas, True
        # Even CPU_max misses the target: hand back the reclaimed replicas until it is met, never
        # more than the stage had before the smoother reclaimed (more would be a scale-up, the
        # corrector's call). Where the service time alone exceeds the target, replicas cannot
        # help: the stage keeps what it had.
        fastest = fit.predict(self.cpu_max, s.payload)
        if fastest >= target:
            return self.cpu_max, s.replicas, False
        needed = min_servers(s.arrival_rate, 1.0 / fastest, target - fastest, s.arrival_cv ** 2,
                             s.service_cv ** 2, limit=r_max)
        replicas = min(s.replicas, max(replicas, needed))
        return self.cpu_max, replicas, sojourn(s, fastest, replicas) <= target


def within_total(states: list[PipelineState], decisions: list[Decision], r_total: int) -> list[Decision]:
    """Algorithm 1's R_total over every model: the CPUs all replicas hold together (replicas ×
    CPUs per stage) do not pass `r_total`. Where the compensator's raises would pass it, they are
    taken back one CPU at a time from the stage holding the most CPUs per replica among those it
    raised; what the replica counts alone hold is the corrector's, left as it is."""
    cpus = [[d.cpus for d in decision.stages] for decision in decisions]
    total = sum(d.replicas * c for decision, row in zip(decisions, cpus) for d, c in zip(decision.stages, row))
    while total > r_total:
        raised = [(row[k], m, k) for m, (state, row) in enumerate(zip(states, cpus))
                  for k, s in enumerate(state.stages) if row[k] > max(1.0, s.cpus)]
        if not raised:
            break
        _, m, k = max(raised)
        cpus[m][k] -= 1
        total -= decisions[m].stages[k].replicas
    out = []
    for decision, row in zip(decisions, cpus):
        stages = tuple(d if d.cpus == c else StageDecision(d.stage, d.replicas, c, d.key, {**d.reason, "cpu_total_bound": c})
                       for d, c in zip(decision.stages, row))
        out.append(Decision(decision.model, decision.policy, stages))
    return out
