"""Emulated models' profiles: QUART's Table 1 (standalone GPU execution time and parameter size of
the whole model) split over 8 stages with uneven weights, so that one stage is heavier than the
others; and the stack file of one of them. Data only (no torch): the provider reads it too."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from contracts.paths import REPO_ROOT

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


def write_stack(model: str, path: Path) -> Path:
    """An OpenFaaS stack file of one emulated model of PROFILES (an entry and one function per
    stage, like stack-emulated.yml's llama-7b), for a run that needs another profile."""
    stages = profile(model).num_stages

    def function(handler: str, **env: str) -> dict:
        return {"lang": "quart-python", "handler": str(REPO_ROOT / "functions" / handler), "image": f"quart/{handler}:0.1.0",
                "environment": {"QUART_MODEL": model, **env, "QUART_EMULATE": model},
                "labels": {"com.openfaas.scale.min": "1"}}
    functions = {model: function("entry")}
    functions.update({f"{model}-s{i}": function("stage", QUART_STAGES=str(i)) for i in range(stages)})
    path.write_text(yaml.safe_dump({"version": "1.0", "provider": {"name": "openfaas"}, "functions": functions},
                                   sort_keys=False))
    return path
