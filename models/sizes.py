"""How many bytes of parameters a stage range holds: what a cold start reads and what a cached
zygote takes from a server's budget (emulated models count their nominal size, QUART Table 1);
and what a function's replica needs in memory, the requests and limits a stack file gives it."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from contracts.config import ComputeConfig
from models.manifest import Manifest
from models.profiles import PROFILES


def stage_bytes(models_dir: Path, model: str, first: int, last: int) -> int:
    """FileNotFoundError for a model that is nowhere; ValueError for a range it does not have."""
    manifest_dir = models_dir / model
    if (manifest_dir / "manifest.json").exists():
        stages = Manifest.load(manifest_dir).stages
    elif model in PROFILES:
        stages = range(PROFILES[model].num_stages)
    else:
        raise FileNotFoundError(f"{model} is neither partitioned in {models_dir} nor an emulation profile "
                                f"(python -m models.partition --model {model} --stages S)")
    if last > len(stages):
        raise ValueError(f"{model} has {len(stages)} stages; stages [{first}, {last}) are not all among them")
    if isinstance(stages, range):
        return PROFILES[model].stage_bytes(first, last)
    return sum(s.bytes for s in stages[first:last])


# A replica's process before its shard: Python, torch, transformers and the watchdog (about 320 MB
# resident measured on the CPU build), with room for the allocator's slack.
RUNTIME_BYTES = 512 << 20
# An entry holds no weights: the runtime and a tokenizer.
ENTRY_MEMORY = {"requests": 512 << 20, "limits": 1 << 30}
ENTRY_CPU = {"requests": "500m", "limits": "1"}


def resident_weight_bytes(shard_bytes: int, checkpoint_dtype: str, compute: ComputeConfig) -> int:
    """A stage's weights in memory at most: served with prepacked linears on the CPU, held twice
    (models/packed_linear.py: packed for oneDNN and plain),
    and widened to float32 where models/precision.py would choose it on a host without native
    bfloat16; else as stored."""
    # Imported here: the runtime server and the autoscaler read stage_bytes without loading torch.
    import torch

    from models.packed_linear import PACKED_DTYPES
    from models.precision import DTYPES, choose_dtype
    served = choose_dtype(compute.dtype, checkpoint_dtype, compute.device, bf16_native=False)
    twice = 2 * shard_bytes * served.itemsize // DTYPES.get(checkpoint_dtype, torch.float32).itemsize
    if compute.device != "cpu" or compute.quantize:
        return shard_bytes
    return twice if served in PACKED_DTYPES and compute.prepack else shard_bytes


@dataclass(frozen=True)
class StageFootprint:
    """What a stage replica needs: its weights as they lie in memory and the process at rest (its
    request), and at most its KV budget and one full pass's activations more (its limit)."""
    weights_bytes: int
    kv_bytes: int
    pass_bytes: int

    @property
    def request_bytes(self) -> int:
        return self.weights_bytes + RUNTIME_BYTES

    @property
    def limit_bytes(self) -> int:
        return self.request_bytes + self.kv_bytes + self.pass_bytes


def pass_bytes(config: dict, max_pass_tokens: int) -> int:
    """The activations of the widest pass a stage takes: its tokens × the MLP's width (the widest
    tensor), a few live at once (gate, up and their product), in float32 at worst."""
    width = int(config.get("intermediate_size") or 4 * int(config.get("hidden_size", 0)))
    return max_pass_tokens * width * 4 * 3


def mebibytes(n: int) -> str:
    """A Kubernetes memory quantity, rounded up to whole MiB."""
    return f"{-(-n // (1 << 20))}Mi"
