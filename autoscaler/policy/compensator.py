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
    """service time (s) ≈ b0 + b1 / cpus + b2 · payload: the 1/cpus term is the parallel part."""
    b0: float
    b1: float
    b2: float

    def predict(self, cpus: float, payload: float) -> float:
        return max(1e-6, self.b0 + self.b1 / cpus + self.b2 * payload)


def fit_cpu_profile(samples: list[tuple[float, float, float]]) -> CPUFit:
    """Least squares over (cpus, payload, service seconds) samples."""
    a = np.array([[1.0, 1.0 / c, p] for c, p, _ in samples])
    y = np.array([s for _, _, s in samples])
    b0, b1, b2 = np.linalg.lstsq(a, y, rcond=None)[0]
    return CPUFit(float(b0), float(b1), float(b2))


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
