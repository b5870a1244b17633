"""Emulated models' profiles: QUART's Table 1 (standalone GPU execution time and parameter size of
the whole model) split evenly over 8 stages, as DeepSpeed's balanced partitioning splits a stack of
identical layers, so that key stages arise from the workload, not from the split; each also as a
named variant `<name>-uneven` whose stage 3 weighs 1.6 (a heavy stage by construction); and the
stack file of one of them. Data only (no torch): the provider reads it too."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import yaml

from contracts.paths import REPO_ROOT

EVEN_8 = (1.0,) * 8
UNEVEN_8 = (0.8, 1.0, 1.0, 1.6, 1.0, 0.9, 0.9, 0.8)
WIDTH = 64


@dataclass(frozen=True)
class Profile:
    name: str
    total_ms: float
    cv: float = 0.3
    parallel_fraction: float = 0.8
    weights: tuple[float, ...] = EVEN_8
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
TABLE1 = (Profile("whisper-9b", 74, size_gb=2.9), Profile("bert-21b", 137, size_gb=43),
          Profile("llama-7b", 243, size_gb=14), Profile("opt-66b", 278, size_gb=132),
          Profile("wideresnet", 646, size_gb=16))
UNEVEN = "-uneven"
PROFILES = {p.name: p for p in TABLE1} | {
    p.name + UNEVEN: dataclasses.replace(p, name=p.name + UNEVEN, weights=UNEVEN_8) for p in TABLE1}


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
