"""How many bytes of parameters a stage range holds: what a cold start reads and what a cached
zygote takes from a server's budget. Emulated models count their nominal size (QUART Table 1)."""
from __future__ import annotations

from pathlib import Path

from pipeline.manifest import Manifest
from pipeline.profiles import PROFILES


def stage_bytes(models_dir: Path, model: str, first: int, last: int) -> int:
    manifest_dir = models_dir / model
    if (manifest_dir / "manifest.json").exists():
        return sum(s.bytes for s in Manifest.load(manifest_dir).stages[first:last])
    if model in PROFILES:
        return PROFILES[model].stage_bytes(first, last)
    raise FileNotFoundError(f"{model} is neither partitioned in {models_dir} nor an emulation profile")
