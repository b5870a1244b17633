"""Emulated stages: the wire format and queues are real, the compute is a sleep drawn from a
profile (mean and CV per stage, Gamma-distributed), so a 2-core machine can show many replicas
"computing" at once. Everything measured with it is labelled emulated.

The profiles (models/profiles.py) come from QUART's Table 1. CPU count scales a service time by
Amdahl's law with a parallel fraction."""
from __future__ import annotations

import time

import numpy as np
import torch

from contracts.config import Limits
from contracts.wire import BadRequest, check_size
from models.profiles import WIDTH, Profile


class EmulatedManifest:
    """What a replica needs to know of an emulated model."""

    def __init__(self, p: Profile, model: str) -> None:
        self.model, self.profile, self.num_stages = model, p, p.num_stages


class EmulatedRunner:
    """Stand-in for StageRunner: validates and passes the activation on after a drawn sleep."""

    emulated = True

    def __init__(self, p: Profile, model: str, first: int, last: int, seed: int | None = None) -> None:
        if not 0 <= first < last <= p.num_stages:
            raise ValueError(f"stage range [{first}, {last}) outside 0..{p.num_stages}")
        self.manifest = EmulatedManifest(p, model)
        self.first, self.last = first, last
        self.cpus = 1
        self._rng = np.random.default_rng(seed)

    @property
    def is_last(self) -> bool:
        return self.last == self.manifest.num_stages

    def use_cpus(self, cpus: int) -> None:
        """Emulated compute runs faster by its parallel fraction on more CPUs."""
        self.cpus = cpus

    def reseed(self) -> None:
        """A forked child must not draw the same service times as its siblings."""
        self._rng = np.random.default_rng()

    def service_s(self) -> float:
        p = self.manifest.profile
        mean = sum(p.stage_ms(i) for i in range(self.first, self.last)) / 1000.0
        mean *= (1 - p.parallel_fraction) + p.parallel_fraction / self.cpus
        shape = 1.0 / (p.cv * p.cv)
        return float(self._rng.gamma(shape, mean / shape))

    def join(self, parts: dict[int, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """A join stage's input: the mean of its predecessors' activations (an ensemble's
        combiner averages its members' outputs), which must agree in shape."""
        hidden = [p.get("hidden") for p in parts.values()]
        if any(h is None for h in hidden) or len({tuple(h.shape) for h in hidden}) != 1:
            raise BadRequest(f"the parts joined here differ: {[None if h is None else tuple(h.shape) for h in hidden]}")
        return {"hidden": torch.stack(hidden).mean(dim=0)}

    def checked_run(self, tensors: dict[str, torch.Tensor], limits: Limits) -> dict[str, torch.Tensor]:
        hidden = tensors.get("hidden")
        if hidden is None or hidden.dim() != 3 or hidden.shape[2] != WIDTH or not hidden.is_floating_point():
            raise BadRequest(f"an emulated stage takes 'hidden' of shape [batch, tokens, {WIDTH}]")
        check_size(hidden, limits, limits.max_inputs)
        time.sleep(self.service_s())
        return {"hidden": hidden}

