"""Which dtype `auto` serves, for each kind of checkpoint and hardware (vLLM's `--dtype auto`)."""
from __future__ import annotations

import pytest
import torch

from models.packed_linear import can_pack, layout_for
from models.precision import choose_dtype


@pytest.mark.parametrize("requested, checkpoint, device, native, expected", [
    ("auto", "float32", "cpu", True, torch.bfloat16),      # AVX512-BF16 or AMX
    ("auto", "float32", "cpu", False, torch.float32),      # bfloat16 would be emulated: slower
    ("auto", "float32", "cuda", True, torch.bfloat16),
    ("auto", "float32", "cuda", False, torch.float16),     # a GPU before compute capability 8
    ("auto", "bfloat16", "cpu", False, torch.bfloat16),    # a 16-bit checkpoint keeps its own
    ("auto", "float16", "cpu", True, torch.float16),
    ("float32", "bfloat16", "cpu", True, torch.float32),   # asked for, whatever the hardware
    ("bf16", "float32", "cpu", False, torch.bfloat16),
])
def test_auto_picks_low_precision_where_the_hardware_has_it(requested, checkpoint, device, native, expected):
    assert choose_dtype(requested, checkpoint, device, native) == expected


def test_an_unknown_dtype_is_refused_by_name():
    with pytest.raises(ValueError, match="int4"):
        choose_dtype("int4", "float32", "cpu", True)


def test_linear_layouts_follow_the_device_and_refuse_what_cannot_run():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert layout_for(cpu, torch.float32, prepack=True, quantize="") == "packed"
    # oneDNN packs bfloat16 only where the CPU has what its bfloat16 path needs (AVX512BW/VL/DQ, AVX-NE-CONVERT)
    assert layout_for(cpu, torch.bfloat16, prepack=True, quantize="") == ("packed" if can_pack(cpu, torch.bfloat16) else None)
    assert layout_for(cpu, torch.bfloat16, prepack=False, quantize="") is None
    assert layout_for(cpu, torch.float16, prepack=True, quantize="") is None   # oneDNN packs float32 and bfloat16
    assert layout_for(cuda, torch.bfloat16, prepack=True, quantize="") is None
    assert layout_for(cpu, torch.float32, prepack=True, quantize="int8") == "int8"
    with pytest.raises(ValueError, match="CPU"):
        layout_for(cuda, torch.bfloat16, prepack=True, quantize="int8")
    with pytest.raises(ValueError, match="int4"):
        layout_for(cpu, torch.bfloat16, prepack=True, quantize="int4")
