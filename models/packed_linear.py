"""Linear layers with their weights reordered once, at load, into oneDNN's blocked layout: what
torch.compile's inductor does to a frozen model's linears on the CPU (`mkldnn._linear_pointwise`
on a weight from `mkldnn._reorder_linear_weight`), without freezing the model. `F.linear` reorders a
weight's blocks on every call; a decode step, which reads each weight once, then streams at
about half the memory bandwidth (measured: 106 MB of bfloat16 weights at one token in 10.8 ms
through `F.linear` and 6.0 ms prepacked, two threads). Compiled decode steps call these layers as
they are (`packed_linear` below): freezing would take minutes per replica and a second copy.

In float32 no one layout wins at every batch size (measured on an AVX2 EPYC, one thread,
2048×5632): at one token oneDNN's kernel on the packed weight is slower than the BLAS on the plain
one (4.7 ms against 3.3), and costs ~45 µs a call more whatever the size; from four tokens on it is
much faster (4: 6.6 ms against 18.0; 16: 14.6 against 25.9; a 70-token prefill: 47 against 64).
With plain float32 weights the llama1b pipeline decoded one request about 1.2× faster but made
half the tokens at 16 concurrent requests (docs/benchmarks.md). So a float32 layer, where torch
has MKL, also keeps its weight packed for MKL's sgemm at one row (`_mkl_reorder_linear_weight`,
what inductor's freezing uses for float32 linears) and multiplies one-token steps through it
(2048×5632: 3.4 ms; 576×1536: 0.16 ms against 0.38 through oneDNN and 0.22 plain): the weights
take twice their memory, and a single request's step is the fastest of the three.

In bfloat16 a layer keeps its plain weight too, for compiled one-row steps (a single sequence's
decode, `models/compiled_decode.py`): there oneDNN's kernel costs ~20 µs a call whatever the size
and read 576×1536 at 6.8 GB/s on one thread of an AVX512-BF16 EPYC, where inductor's own reduction
over the plain weight, generated into the step, read it at 13.0 (136 µs against 260; 1536×576 122
against 222; one SmolLM2 stage's step 7.5 ms against 17.1). Eager steps, and compiled steps of
several sequences, use the packed weight. The weights take twice their memory, as in float32.

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
from torch import nn

# The dtypes a layer is packed in: each holds its weight twice, at most (the module's docstring).
PACKED_DTYPES = (torch.float32, torch.bfloat16)


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and dtype in PACKED_DTYPES and _packs(dtype))


@cache
def _packs_rows() -> bool:
    """Whether this torch has MKL's packed sgemm (x86 builds with MKL)."""
    if not torch.backends.mkl.is_available():
        return False
    try:
        torch.ops.mkl._mkl_reorder_linear_weight(torch.zeros(16, 16), 1)
    except (RuntimeError, AttributeError):
        return False
    return True


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


def _one_row(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One row times the plain weight as a reduction in float32, which inductor generates as a
    vectorised loop over the weight's rows: no library call, no per-call set-up."""
    y = (x.float().unsqueeze(-2) * weight.float()).sum(-1)
    return (y + bias.float() if bias is not None else y).to(x.dtype)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, row_packed: torch.Tensor | None,
                   plain_shape: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if row_packed is not None and x.numel() == plain_shape.shape[1]:
        return torch.ops.mkl._mkl_linear(x, row_packed, plain_shape, bias, 1)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# A compiled step (models/compiled_decode.py) calls the packed layer as one opaque kernel:
# inductor has no lowering for `_linear_pointwise` on a weight packed outside its own freezing pass
# (it fails at lowering), and its freezing pass would pack a second copy of every weight.
@torch.library.custom_op("quart::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, row_packed: torch.Tensor | None, plain_shape: torch.Tensor,
                  bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return _packed_linear(x, packed, row_packed, plain_shape, bias)


@packed_linear.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, row_packed: torch.Tensor | None, plain_shape: torch.Tensor,
      bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


class PackedLinear(nn.Module):
    """`nn.Linear`'s computation on a prepacked weight (a buffer: no gradient, no dtype moves);
    in float32, one-row steps on a second packing for MKL's sgemm (see the module's docstring)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        # Packed for no particular batch size: continuous batching runs every size from 1 up.
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight, None), persistent=False)
        rows = weight.dtype == torch.float32 and _packs_rows()
        self.register_buffer("row_packed", torch.ops.mkl._mkl_reorder_linear_weight(weight, 1) if rows else None,
                             persistent=False)
        # `_mkl_linear` takes the output's shape from the plain weight, which it reads only for a
        # batch size other than the packing's; a one-row step never is, so a view without storage.
        self.plain_shape = torch.zeros((), dtype=weight.dtype).expand(self.out_features, self.in_features)
        # In bfloat16, compiled one-row steps read the weight as it was (the module's docstring).
        self.register_buffer("plain", weight if weight.dtype == torch.bfloat16 else None, persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # Decided as the graph is traced: a compiled step of one sequence has one row.
            if self.plain is not None and x.numel() == self.in_features:
                return _one_row(x, self.plain, self.bias)
            return packed_linear(x, self.packed, self.row_packed, self.plain_shape, self.bias, self.out_features)
        return _packed_linear(x, self.packed, self.row_packed, self.plain_shape, self.bias)

    def unpacked(self) -> nn.Linear:
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        weight = self.plain if self.plain is not None else self.packed.to_dense()
        linear.weight = nn.Parameter(weight, requires_grad=False)
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
