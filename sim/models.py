"""The simulated models: QUART Table 1's five, as 8-stage pipelines with the emulation profiles'
stage times and parameter sizes (models/emulated.py), plus the activation each stage hands to
the next, which sets the hop's transfer time; and generative models, whose stages' batched steps
cost what their calibration measured (sim/calibration/<model>.json)."""
from __future__ import annotations

from dataclasses import dataclass

from autoscaler.policy.compensator import CPUFit
from contracts.stage_graph import chain
from models.profiles import PROFILES, TABLE1, UNEVEN, Profile
from sim.step_cost import Calibration, calibrated


@dataclass(frozen=True)
class SimModel:
    name: str
    profile: Profile
    activation_bytes: int       # what one request passes between two stages

    @property
    def num_stages(self) -> int:
        return self.profile.num_stages

    def graph(self) -> tuple[tuple[int, int], ...]:
        return self.profile.graph()

    def critical_path(self) -> list[int]:
        """The stages of the longest path by mean service time: a request alone takes that long."""
        best: dict[int, tuple[float, list[int]]] = {0: (self.profile.stage_ms(0), [0])}
        for a, b in sorted(self.graph()):
            length, path = best[a]
            candidate = (length + self.profile.stage_ms(b), path + [b])
            if b not in best or candidate[0] > best[b][0]:
                best[b] = candidate
        return best[self.num_stages - 1][1]

    def stage_bytes(self, stage: int) -> int:
        return self.profile.stage_bytes(stage, stage + 1)

    def cpu_fits(self, overhead_s: float = 0.0) -> dict[int, CPUFit]:
        """The CPU compensator's fits of the law the simulator draws service times from (Amdahl's,
        as the emulated stages sleep): what profiling a stage would measure, without the noise."""
        p = self.profile
        return {i: CPUFit(p.stage_ms(i) / 1000.0 * (1 - p.parallel_fraction) + overhead_s,
                          p.stage_ms(i) / 1000.0 * p.parallel_fraction, 0.0) for i in range(self.num_stages)}


@dataclass(frozen=True)
class GenerativeModel:
    """Requests prefill their prompt, then decode `new_tokens` - 1 further tokens one step at a
    time (end of text ignored, as the benchmarks ask), each stage's replicas batching their steps."""
    name: str
    calibration: Calibration
    new_tokens: int = 64

    @property
    def num_stages(self) -> int:
        return self.calibration.num_stages

    def graph(self) -> tuple[tuple[int, int], ...]:
        return chain(self.num_stages)

    def stage_bytes(self, stage: int) -> int:
        return self.calibration.shard_bytes[stage]


# Activation per request, bf16: tokens (Table 1's "Token" column where it has one) times the
# hidden width of the published architecture. Whisper: 1500 encoder frames x 1280 (large-v2);
# WideResNet-101: a 1024 x 14 x 14 feature map. BERT-21B has no public configuration; 6144 wide
# is our assumption for a 21 B encoder.
ACTIVATION_BYTES = {"whisper-9b": 1500 * 1280 * 2, "bert-21b": 128 * 6144 * 2, "llama-7b": 1024 * 4096 * 2,
                    "opt-66b": 128 * 9216 * 2, "wideresnet": 1024 * 14 * 14 * 2}


# The DAGs' activations: those of the model whose time and size they spread.
DAGS = {"ensemble-8": "llama-7b"}


def table1(names: list[str] | None = None) -> list[SimModel]:
    """Table 1's models by name (None: the five, evenly split); `<name>-uneven` the named variant."""
    names = names or [p.name for p in TABLE1]
    unknown = [n for n in names if n not in PROFILES]
    if unknown:
        raise ValueError(f"unknown model(s) {unknown}; known: {sorted(PROFILES)}")
    return [_sim_model(n) for n in names]


def _sim_model(name: str) -> SimModel:
    like = DAGS.get(name, name.removesuffix(UNEVEN))
    return SimModel(name, PROFILES[name], ACTIVATION_BYTES[like])


def resolve(names: list[str] | None, new_tokens: int = 64) -> list[SimModel | GenerativeModel]:
    """Table 1 models and calibrated generative ones by name (None: all of Table 1)."""
    generative = calibrated()
    known = sorted(PROFILES) + sorted(generative)
    unknown = [n for n in names or [] if n not in known]
    if unknown:
        raise ValueError(f"unknown model(s) {unknown}; known: {known}")
    if not names:
        return table1()
    return [GenerativeModel(n, Calibration.load(generative[n]), new_tokens) if n in generative
            else _sim_model(n) for n in names]
