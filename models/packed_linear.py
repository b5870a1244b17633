"""Linear layers with their weights reordered once, at load, into oneDNN's blocked layout: what
torch.compile's inductor does to a frozen model's linears on the CPU (`mkldnn._linear_pointwise`
on a weight from `mkldnn._reorder_linear_weight`), without freezing the model. `F.linear` reorders a
weight's blocks on every call; a decode step, which reads each weight once, then streams at
about half the memory bandwidth (measured: 106 MB of bfloat16 weights at one token in 10.8 ms
through `F.linear` and 6.0 ms prepacked, two threads). Compiled decode steps call these layers as
they are (`packed_linear` below): freezing would take minutes per replica and a second copy.

Every layer also keeps its plain weight, for one-row steps (a single sequence's decode). There
oneDNN's kernel costs ~20 µs a call whatever the size, and a custom op around it (what a compiled
step calls) more. In a compiled step of one sequence (`models/compiled_decode.py`) a layer is
inductor's own reduction over the plain weight, generated into the step. In bfloat16 (an AVX512-BF16
EPYC, one thread) it read 576×1536 at 13.0 GB/s where oneDNN's kernel read 6.8 (136 µs against
260; one SmolLM2 stage's step 7.5 ms against 17.1). In float32 it replaced MKL's sgemm on a
weight packed for one row (`_mkl_reorder_linear_weight`, what inductor's freezing uses), whose
call through the custom op read 1536×576 at 6.5-7.2 GB/s against the reduction's 14.7-17.2; one
SmolLM2 stage's compiled step of 11 layers took 10.3 ms against 21.0 (the same EPYC). An eager
one-row step in float32 multiplies the plain weight through the BLAS; in bfloat16, through oneDNN's
packed kernel. A compiled step of 2 to FEW_ROWS sequences reads the plain weight too, as one
reduction per row fused into one loop (`_few_rows`): each weight element is loaded once for all
the rows. Other steps of several rows (prefills, mixed or eager steps, larger compiled batches) use
the packed weight: in float32 from four tokens on it is much faster than the plain one through the
BLAS (an AVX2 EPYC, one thread, 2048×5632: 4 tokens 6.6 ms against 18.0; 16: 14.6 against 25.9; a
70-token prefill: 47 against 64). Either way a layer holds its weight twice.

Only on the CPU, and only where torch was built with oneDNN; everywhere else layers stay
`nn.Linear`. `unpack` restores them (a replica moving to another device or dtype).

`QUART_QUANTIZE=int8` stores each weight as int8 with one float scale per output channel
(symmetric, round to nearest) and multiplies through `aten._weight_int8pack_mm`, torch's own CPU
kernel for weight-only int8 (the one torchao's and gpt-fast's int8 modes call): half the bytes of
bfloat16, at a cost in agreement with float32 that the generation benchmark measures. Unpacking
an int8 layer gives back its quantized values, not the original weights."""
from __future__ import annotations

from functools import cache

import torch
import torch._inductor.inductor_prims  # noqa: F401 - registers torch.ops.prims.inductor_force_stride_order
import torch.nn.functional as F
from torch import nn

from models.decode_batches import FEW_ROWS

# The dtypes a layer is packed in: each holds its weight twice, at most (the module's docstring).
PACKED_DTYPES = (torch.float32, torch.bfloat16)


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and dtype in PACKED_DTYPES and _packs(dtype))


@cache
def _packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN reorders a weight of `dtype` on this CPU (its bfloat16 path needs AVX512BW/VL/DQ
    or AVX-NE-CONVERT): asked of the library once, as the CPU flags it wants are its own to list."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), None)
    except RuntimeError:
        return False
    return True


def layout_for(device: torch.device, dtype: torch.dtype, prepack: bool, quantize: str) -> str | None:
    """The linear layers' layout: "int8", "packed", or None for plain `nn.Linear`."""
    if quantize == "int8":
        if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"int8 weights (QUART_QUANTIZE) run on the CPU in float32 or bfloat16, not {device} {dtype}")
        return "int8"
    if quantize:
        raise ValueError(f"unknown quantization {quantize!r}; choose int8 or leave it empty")
    return "packed" if prepack and can_pack(device, dtype) else None


# How many row blocks a one-row step reads at once (a divisor of the weight's rows, at most this).
ROW_STREAMS = 8


def _one_row(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One row times the plain weight as a reduction in float32, which inductor generates as a
    vectorised loop over the weight's rows: no library call, no per-call set-up.

    The rows are cut into equal blocks, each its own reduction over the same input: inductor fuses
    them into one loop that reads every block's next row together, so one thread streams several
    parts of the weight at once and keeps as many sums in flight. One row at a time, a thread waits
    on each read (measured on a 2-core AMX Xeon, one thread, bfloat16: eleven SmolLM2 layers' linears
    7.4 ms in one stream, 4.3 in eight). Each row's sum is the same either way."""
    xs = x.float().unsqueeze(-2)
    rows = weight.shape[0]
    streams = next(n for n in range(min(ROW_STREAMS, rows), 0, -1) if rows % n == 0)
    y = torch.cat([(xs * block.float()).sum(-1) for block in weight.split(rows // streams)], -1)
    return (y + bias.float() if bias is not None else y).to(x.dtype)


def _few_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Several rows times the plain weight, each row its own reduction over the whole weight in
    float32. Inductor fuses a batch's reductions over the same weight into one loop that loads each
    weight element once for every row, so a batch of a few rows reads the weight once, as a single
    row does. A BLAS or oneDNN call for a few rows reads it at little more than half the speed
    (measured on the 2-core AVX2 EPYC, one thread, float32, eight SmolLM2 layers' linears, 113 MB:
    2 rows 6.8 ms here against 13.5 through MKL and 13.6 through oneDNN; 4 rows 8.7 against 15.5;
    8 rows 13.2 against 18.9; one row 6.8; 16 rows 28.1 against 23.8, so past FEW_ROWS the packed
    kernel). One block per row: more streams a row, as `_one_row` reads, were slower from 2 rows on
    there. The rows must be a size the graph was traced at (torch unrolls them)."""
    rows = x.reshape(-1, x.shape[-1]).float()
    # Computed once, into a buffer of its own. Each row is read by only a few reductions, so
    # inductor would inline what produces it (the layer's norm: a square root and two products)
    # into every reduction's loop, once per weight element and row: a SmolLM2 stage's step of 8
    # sequences took 29.8 ms that way, 20.7 with the rows realized (the AVX2 EPYC, one thread).
    rows = torch.ops.prims.inductor_force_stride_order(rows, rows.stride())
    plain = weight.float()
    y = torch.stack([(row * plain).sum(-1) for row in rows.unbind(0)])
    y = y + bias.float() if bias is not None else y
    return y.view(*x.shape[:-1], weight.shape[0]).to(x.dtype)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# A compiled step (models/compiled_decode.py) calls the packed layer as one opaque kernel:
# inductor has no lowering for `_linear_pointwise` on a weight packed outside its own freezing pass
# (it fails at lowering), and its freezing pass would pack a second copy of every weight.
@torch.library.custom_op("quart::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return _packed_linear(x, packed, bias)


@packed_linear.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


class PackedLinear(nn.Module):
    """`nn.Linear`'s computation on a prepacked weight (a buffer: no gradient, no dtype moves),
    and one-row steps on the plain weight where that is faster (the module's docstring)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        # Packed for no particular batch size: continuous batching runs every size from 1 up.
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight, None), persistent=False)
        self.register_buffer("plain", weight, persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        one_row = x.numel() == self.in_features
        if torch.compiler.is_compiling():
            # Decided as the graph is traced, a graph for each size up to FEW_ROWS (the step
            # guards on it) and one for every larger size.
            if one_row:
                return _one_row(x, self.plain, self.bias)
            if x.numel() <= FEW_ROWS * self.in_features:
                return _few_rows(x, self.plain, self.bias)
            return packed_linear(x, self.packed, self.bias, self.out_features)
        if one_row and x.dtype == torch.float32:
            return F.linear(x, self.plain, self.bias)
        return _packed_linear(x, self.packed, self.bias)

    def unpacked(self) -> nn.Linear:
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight = nn.Parameter(self.plain, requires_grad=False)
        linear.bias = self.bias
        return linear

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int8Linear(nn.Module):
    """`nn.Linear` on int8 weights with a scale per output channel."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()
        scales = weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.register_buffer("qweight", torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8),
                             persistent=False)
        self.register_buffer("scales", scales.to(linear.weight.dtype), persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The kernel takes a matrix: the step's tokens flattened, whatever the leading dimensions.
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, self.in_features), self.qweight, self.scales)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y + self.bias if self.bias is not None else y

    def unpacked(self) -> nn.Linear:
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        weight = (self.qweight.float() * self.scales.float()[:, None]).to(self.scales.dtype)
        linear.weight = nn.Parameter(weight, requires_grad=False)
        linear.bias = self.bias
        return linear

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


LAYOUTS = {"packed": PackedLinear, "int8": Int8Linear}


def pack(module: nn.Module, layout: str = "packed") -> int:
    """Replaces every `nn.Linear` under `module` by a layer of `layout`; how many it replaced."""
    return _swap(module, (nn.Linear,), LAYOUTS[layout])


def unpack(module: nn.Module) -> int:
    return _swap(module, tuple(LAYOUTS.values()), lambda layer: layer.unpacked())


def _swap(module: nn.Module, kinds: tuple[type, ...], make) -> int:
    targets = [(parent, name, child) for parent in module.modules()
               for name, child in parent.named_children() if type(child) in kinds]
    for parent, name, child in targets:
        setattr(parent, name, make(child))
    return len(targets)
