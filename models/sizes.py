"""How many bytes of parameters a stage range holds: what a cold start reads and what a cached
zygote takes from a server's budget. Emulated models count their nominal size (QUART Table 1)."""
from __future__ import annotations

from pathlib import Path

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
