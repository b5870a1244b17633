"""What one batched step of a generative stage costs, fitted to steps measured on the real stage
(`python -m sim.calibrate`), and the calibration file that carries the fits of a model's stages
with what else the simulator needs of it: KV bytes per position, the hidden state's size, shard
sizes, a sample of prompt lengths, and what its data plane costs besides the steps, fitted
against the live pipeline (`python -m benchmarks simulator_generation`)."""
from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from models.decode_batches import FEW_ROWS, padded

CALIBRATIONS = Path(__file__).resolve().parent / "calibration"
# A step is (new tokens, position of the first): a prefill is (prompt, 0), a decode step (1, context).
Step = tuple[int, int]


def features(steps: list[Step]) -> list[float]:
    """What a batch's time grows with: a fixed part, tokens (projections and MLPs run over all of
    them flat), requests (attention runs per request; the head projects each one's last position)
    and attention's work (each new token against every position up to its own)."""
    tokens = sum(t for t, _ in steps)
    attention = sum(t * start + t * (t + 1) / 2 for t, start in steps)
    return [1.0, float(tokens), float(len(steps)), attention / 1000.0]


def decode_features(steps: list[Step]) -> list[float]:
    """A compiled decode step's: features() of the batch as it runs, padded to its bucket
    (models/decode_batches.py), whether it batches several sequences, and whether more than the
    buckets hold. Each regime runs other kernels for its linear layers (models/packed_linear.py):
    one sequence's graph of its own, a few rows' reductions, the packed kernel past them; one line
    through 1-16 sequences missed the single sequence by 7-18 % (SmolLM2's stages, float32, one
    thread)."""
    return features(padded(steps)) + [1.0 if len(steps) > 1 else 0.0, 1.0 if len(steps) > FEW_ROWS else 0.0]


def decode_only(steps: list[Step]) -> bool:
    """Whether every step is one new token after a prefill: the batches a replica runs compiled
    (models/compiled_decode.py); a prefill, even of one token, starts at position 0."""
    return all(tokens == 1 and start > 0 for tokens, start in steps)


@dataclass(frozen=True)
class StepCost:
    """Seconds per batch = coefficients · features(steps), the coefficients non-negative. A replica
    runs decode-only batches through a compiled step and the rest eager, at different costs a
    token: `decode`, where set, is the fit of the compiled decode-only batches, priced as
    decode · decode_features(steps)."""
    coefficients: tuple[float, ...]
    decode: tuple[float, ...] | None = None

    def batch_s(self, steps: list[Step]) -> float:
        if not steps:
            return 0.0
        if self.decode is not None and decode_only(steps):
            # A file written before a feature was added has no coefficient for it: zero.
            return float(np.dot(self.decode, decode_features(steps)[:len(self.decode)]))
        return float(np.dot(self.coefficients, features(steps)))

    @classmethod
    def fit(cls, samples: list[tuple[list[Step], float]],
            compiled_decodes: list[tuple[list[Step], float]] = ()) -> StepCost:
        """Non-negative least squares on relative error, so short steps weigh as much as long ones;
        the compiled decode-only batches, where measured, fitted apart."""
        return cls(_fit(samples, features), _fit(compiled_decodes, decode_features) if compiled_decodes else None)


def _fit(samples: list[tuple[list[Step], float]], features_of: Callable[[list[Step]], list[float]]) -> tuple[float, ...]:
    a = np.array([features_of(steps) for steps, _ in samples])
    y = np.array([seconds for _, seconds in samples])
    return tuple(float(c) for c in _non_negative_lstsq(a / y[:, None], np.ones(len(y))))


def _non_negative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin |a x - b| over x >= 0, exactly, by trying every set of free columns (a has four or five)."""
    best, best_residual = np.zeros(a.shape[1]), float(np.sum(b * b))
    for k in range(1, a.shape[1] + 1):
        for cols in itertools.combinations(range(a.shape[1]), k):
            x, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
            if (x < 0).any():
                continue
            residual = float(np.sum((a[:, cols] @ x - b) ** 2))
            if residual < best_residual:
                best, best_residual = np.zeros(a.shape[1]), residual
                best[list(cols)] = x
    return best


@dataclass(frozen=True)
class Calibration:
    model: str
    stages: tuple[StepCost, ...]
    kv_bytes_per_position: tuple[int, ...]    # per stage: its layers' keys and values of one position
    hidden_bytes: int                          # one token's hidden state between stages
    shard_bytes: tuple[int, ...]               # per stage: its parameters
    prompt_tokens: tuple[int, ...]             # prompt lengths of the sampled prompts
    conditions: dict
    # Fitted against the live pipeline: a step's hand-off latency (None: the preset's hop_s), and
    # the CPU work per item outside the stage's step (packing, Redis, the entry) that takes its
    # share of the host's cores without delaying the item itself.
    hop_s: float | None = None
    item_cpu_s: float = 0.0

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def save(self, path: Path) -> None:
        body = asdict(self)
        body["stages"] = [list(s.coefficients) for s in self.stages]
        body["decode_stages"] = [None if s.decode is None else list(s.decode) for s in self.stages]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in body.items()) + "\n}\n")

    @classmethod
    def load(cls, path: Path) -> Calibration:
        body = json.loads(path.read_text())
        decodes = body.get("decode_stages") or [None] * len(body["stages"])  # older files: eager steps only
        return cls(body["model"], tuple(StepCost(tuple(c), None if d is None else tuple(d))
                                        for c, d in zip(body["stages"], decodes)),
                   tuple(body["kv_bytes_per_position"]), int(body["hidden_bytes"]), tuple(body["shard_bytes"]),
                   tuple(body["prompt_tokens"]), body.get("conditions", {}), body.get("hop_s"),
                   float(body.get("item_cpu_s", 0.0)))


def calibrated() -> dict[str, Path]:
    """The generative models the repository carries calibrations for, by name."""
    return {p.stem: p for p in sorted(CALIBRATIONS.glob("*.json"))}
