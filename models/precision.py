"""The dtype a stage computes in. `auto` follows vLLM's `--dtype auto`: a checkpoint already in
16 bits keeps its dtype; a float32 checkpoint is served in bfloat16 where the hardware computes
it natively (CPUs with AVX512-BF16 or AMX, CUDA GPUs of compute capability 8 and later), in
float16 on older GPUs, and in float32 elsewhere. A decode step reads every weight once, so half
the bytes is nearly half the time on a memory-bound step."""
from __future__ import annotations

from functools import cache
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
AUTO = "auto"
_CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def choose_dtype(requested: str, checkpoint: str, device: str, bf16_native: bool) -> torch.dtype:
    """`requested`: a dtype's name or `auto`; `checkpoint`: the checkpoint's dtype's name;
    `bf16_native`: whether `device` computes bfloat16 natively."""
    if requested != AUTO:
        try:
            return DTYPES[requested]
        except KeyError:
            raise ValueError(f"unknown dtype {requested!r}; choose from {sorted(DTYPES)} or {AUTO}") from None
    own = DTYPES.get(checkpoint, torch.float32)
    if own != torch.float32:
        return own
    if bf16_native:
        return torch.bfloat16
    return torch.float16 if device.startswith("cuda") else torch.float32


def bf16_native(device: str) -> bool:
    """Whether `device` computes bfloat16 in hardware (not emulated through float32)."""
    if device.startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    return any(flag in cpu_flags() for flag in _CPU_BF16_FLAGS)


@cache
def cpu_field(name: str) -> str:
    """The first CPU's `name` field in /proc/cpuinfo ("flags", "model name"); empty where there is
    none (not Linux: no flags to read, so no claim of native bfloat16)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    return ""


def cpu_flags() -> frozenset[str]:
    return frozenset(cpu_field("flags").split())


def serving_dtype(requested: str, checkpoint: str, device: str) -> torch.dtype:
    return choose_dtype(requested, checkpoint, device, bf16_native(device))
