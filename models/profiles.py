"""Emulated models' profiles: QUART's Table 1 (standalone GPU execution time and parameter size of
the whole model) split evenly over 8 stages, as DeepSpeed's balanced partitioning splits a stack of
identical layers, so that key stages arise from the workload, not from the split; each also as a
named variant `<name>-uneven` whose stage 3 weighs 1.6 (a heavy stage by construction); a DAG,
`ensemble-8`; and the stack file of one of them. Data only (no torch): the provider reads it too."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import yaml

from contracts.paths import REPO_ROOT
from contracts.stage_graph import Edges, chain

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
    # The stage graph (contracts/stage_graph.py); None: a chain.
    edges: Edges | None = None

    @property
    def num_stages(self) -> int:
        return len(self.weights)

    def graph(self) -> Edges:
        return self.edges if self.edges is not None else chain(self.num_stages)

    def stage_ms(self, stage: int) -> float:
        return self.total_ms * self.weights[stage] / sum(self.weights)

    def stage_bytes(self, first: int, last: int) -> int:
        return int(self.size_gb * 1e9 * sum(self.weights[first:last]) / sum(self.weights))


# QUART Table 1, "Exec. (ms)" and "Size (GB)".
TABLE1 = (Profile("whisper-9b", 74, size_gb=2.9), Profile("bert-21b", 137, size_gb=43),
          Profile("llama-7b", 243, size_gb=14), Profile("opt-66b", 278, size_gb=132),
          Profile("wideresnet", 646, size_gb=16))
UNEVEN = "-uneven"
# A fan-out/fan-in pipeline (QUART §4.1's DAG): a shared encoder (stage 0) feeds an ensemble of
# three models of two stages each (1 -> 4, 2 -> 5, 3 -> 6), a large, a medium and a small one,
# whose outputs a combiner (stage 7) joins; LLaMA-7B's time and size spread over the 8 stages.
ENSEMBLE = Profile("ensemble-8", 243, size_gb=14, weights=(1.0, 1.6, 1.0, 0.5, 1.6, 1.0, 0.5, 1.0),
                   edges=((0, 1), (0, 2), (0, 3), (1, 4), (2, 5), (3, 6), (4, 7), (5, 7), (6, 7)))
PROFILES = {p.name: p for p in TABLE1} | {
    p.name + UNEVEN: dataclasses.replace(p, name=p.name + UNEVEN, weights=UNEVEN_8) for p in TABLE1} | {
    ENSEMBLE.name: ENSEMBLE}


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
