"""Emulated stages: the wire format and queues are real, the compute is a sleep drawn from a
profile (mean and CV per stage, Gamma-distributed), so a 2-core machine can show many replicas
"computing" at once. Everything measured with it is labelled emulated.

A profile's stage times come from QUART's Table 1 (standalone GPU execution time of the whole
model) split over 8 stages with uneven weights, so that one stage is heavier than the others.
CPU count scales a service time by Amdahl's law with a parallel fraction."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import yaml

from contracts.config import Limits
from contracts.paths import REPO_ROOT
from contracts.wire import BadRequest, check_size

WEIGHTS_8 = (0.8, 1.0, 1.0, 1.6, 1.0, 0.9, 0.9, 0.8)
WIDTH = 64


@dataclass(frozen=True)
class Profile:
    name: str
    total_ms: float
    cv: float = 0.3
    parallel_fraction: float = 0.8
    weights: tuple[float, ...] = WEIGHTS_8
    # Parameter size of the whole model (QUART Table 1), for cache budgets and cold-start
    # reads; an emulated zygote holds none of it.
    size_gb: float = 0.0

    @property
    def num_stages(self) -> int:
        return len(self.weights)

    def stage_ms(self, stage: int) -> float:
        return self.total_ms * self.weights[stage] / sum(self.weights)

    def stage_bytes(self, first: int, last: int) -> int:
        return int(self.size_gb * 1e9 * sum(self.weights[first:last]) / sum(self.weights))


# QUART Table 1, "Exec. (ms)" and "Size (GB)".
PROFILES = {p.name: p for p in (Profile("whisper-9b", 74, size_gb=2.9), Profile("bert-21b", 137, size_gb=43),
                                Profile("llama-7b", 243, size_gb=14), Profile("opt-66b", 278, size_gb=132),
                                Profile("wideresnet", 646, size_gb=16))}


def profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown emulation profile {name!r}; known: {sorted(PROFILES)}") from None


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

    def reseed(self) -> None:
        """A forked child must not draw the same service times as its siblings."""
        self._rng = np.random.default_rng()

    def service_s(self) -> float:
        p = self.manifest.profile
        mean = sum(p.stage_ms(i) for i in range(self.first, self.last)) / 1000.0
        mean *= (1 - p.parallel_fraction) + p.parallel_fraction / self.cpus
        shape = 1.0 / (p.cv * p.cv)
        return float(self._rng.gamma(shape, mean / shape))

    def checked_run(self, tensors: dict[str, torch.Tensor], limits: Limits) -> dict[str, torch.Tensor]:
        hidden = tensors.get("hidden")
        if hidden is None or hidden.dim() != 3 or hidden.shape[2] != WIDTH or not hidden.is_floating_point():
            raise BadRequest(f"an emulated stage takes 'hidden' of shape [batch, tokens, {WIDTH}]")
        check_size(hidden, limits, limits.max_inputs)
        time.sleep(self.service_s())
        return {"hidden": hidden}


def write_stack(model: str, path: Path) -> Path:
    """An OpenFaaS stack file of one emulated model of PROFILES (an entry and one function per
    stage, like stack-emulated.yml's llama-7b), for a run that needs another profile."""
    stages = profile(model).num_stages

    def function(handler: str, **env: str) -> dict:
        return {"lang": "python3-http", "handler": str(REPO_ROOT / "functions" / handler), "image": f"quart/{handler}:0.1.0",
                "environment": {"QUART_MODEL": model, **env, "QUART_EMULATE": model},
                "labels": {"com.openfaas.scale.min": "1"}}
    functions = {model: function("entry")}
    functions.update({f"{model}-s{i}": function("stage", QUART_STAGES=str(i)) for i in range(stages)})
    path.write_text(yaml.safe_dump({"version": "1.0", "provider": {"name": "openfaas"}, "functions": functions},
                                   sort_keys=False))
    return path
