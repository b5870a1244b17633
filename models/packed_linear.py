"""Linear layers with their weights reordered once, at load, into oneDNN's blocked layout: what
torch.compile's inductor does to a frozen model's linears on the CPU (`mkldnn._linear_pointwise`
on a weight from `mkldnn._reorder_linear_weight`), without the compile. `F.linear` reorders a
weight's blocks on every call; a decode step, which reads each weight once, then streams at
about half the memory bandwidth (measured: 106 MB of bfloat16 weights at one token in 10.8 ms
through `F.linear` and 6.0 ms prepacked, two threads). torch.compile itself is not used: on a
2-core host it compiles a 30-layer model for minutes, per shape, in every replica.

Only on the CPU, and only where torch was built with oneDNN; everywhere else layers stay
`nn.Linear`. `unpack` restores them (a replica moving to another device or dtype)."""
from __future__ import annotations

import torch
from torch import nn


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and dtype in (torch.float32, torch.bfloat16))


class PackedLinear(nn.Module):
    """`nn.Linear`'s computation on a prepacked weight (a buffer: no gradient, no dtype moves)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # Packed for no particular batch size: continuous batching runs every size from 1 up.
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None),
                             persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def unpacked(self) -> nn.Linear:
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight = nn.Parameter(self.packed.to_dense(), requires_grad=False)
        linear.bias = self.bias
        return linear

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack(module: nn.Module) -> int:
    """Replaces every `nn.Linear` under `module` by a `PackedLinear`; how many it replaced."""
    return _swap(module, nn.Linear, PackedLinear)


def unpack(module: nn.Module) -> int:
    return _swap(module, PackedLinear, PackedLinear.unpacked)


def _swap(module: nn.Module, kind: type, make) -> int:
    targets = [(parent, name, child) for parent in module.modules()
               for name, child in parent.named_children() if type(child) is kind]
    for parent, name, child in targets:
        setattr(parent, name, make(child))
    return len(targets)
