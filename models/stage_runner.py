"""Runs a contiguous range of stages [first, last) of a partitioned model in this process."""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from accelerate import init_empty_weights
from safetensors.torch import load_file

from contracts.config import Limits
from contracts.wire import BadRequest
from models.architectures import StageModule, architecture
from models.batched_decoder import BatchedDecoder
from models.manifest import Manifest, sha256_file
from models.packed_linear import LAYOUTS, layout_for, pack, unpack
from models.precision import AUTO, serving_dtype


def load_stage_module(manifest: Manifest, stage: int, verify: bool = True,
                      tensors: Iterable[tuple[str, torch.Tensor]] | None = None,
                      place: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> StageModule:
    """One stage's module with its shard's weights, on the CPU in the shard's dtype; from
    `tensors` as they arrive (`models/shard_stream.py`; each put in `place` on arrival) instead of
    the file when given."""
    info = manifest.stages[stage]
    arch = architecture(manifest.arch)
    # Parameters start empty (meta) and take the shard's tensors as they are: no random
    # initialisation to throw away, and no kernel runs (a KeysManager zygote must not compute).
    with init_empty_weights(include_buffers=False):
        module = arch.stage(manifest.config_object(), info.layers, info.has_embed, info.has_head, manifest.pooling)
    if tensors is None:
        path = manifest.shard_path(stage)
        if verify and sha256_file(path) != info.sha256:
            raise ValueError(f"shard {path} does not match the sha256 in its manifest; re-partition")
        tensors = load_file(str(path)).items()
    state = {module.rename(k): place(v) for k, v in tensors}
    module.load_state_dict(state, strict=True, assign=True)
    return module.eval()


class StageRunner:
    def __init__(self, manifest: Manifest, first: int, last: int, device: str = "cpu",
                 dtype: str = AUTO, verify: bool = True,
                 tensors: Callable[[int], Iterable[tuple[str, torch.Tensor]]] | None = None,
                 prepack: bool = True, quantize: str = "") -> None:
        """`tensors(stage)`: that stage's tensors as they arrive (a cold start's shard readers);
        each goes to the device and dtype on arrival. Else the shards are read from disk.
        `prepack`: linear weights in oneDNN's layout where it helps; `quantize`: "int8" for int8
        weights (`models/packed_linear.py`)."""
        if not 0 <= first < last <= manifest.num_stages:
            raise ValueError(f"stage range [{first}, {last}) outside 0..{manifest.num_stages}")
        self.manifest, self.first, self.last = manifest, first, last
        want = serving_dtype(dtype, manifest.dtype, device)
        place = lambda t: t.to(device, want if t.is_floating_point() else t.dtype)  # noqa: E731
        self.modules = [load_stage_module(manifest, i, verify, tensors(i) if tensors else None, place)
                        for i in range(first, last)]
        self.layout: str | None = None
        self._batched: BatchedDecoder | None = None
        self.to(device, dtype, prepack, quantize)

    def batched(self) -> BatchedDecoder:
        """The one batched decoder over these modules, kept with them: a replica forked from a
        KeysManager zygote takes the zygote's, and with it the decode step the zygote compiled
        (torch.compile's guards hold for that object, not for a new one over the same modules)."""
        if self._batched is None:
            self._batched = BatchedDecoder(self.modules)
        return self._batched

    def to(self, device: str, dtype: str, prepack: bool = True, quantize: str = "") -> None:
        """Moves the parameters (`dtype` "auto": `models/precision.py`) and lays out the linear
        weights as `prepack` and `quantize` ask and the device allows; a no-op (no copy) where they
        already are in that form. Buffers keep their dtype: rotary frequencies stay float32, as
        transformers keeps them in a model loaded in low precision."""
        device_, dtype_ = torch.device(device), serving_dtype(dtype, self.manifest.dtype, device)
        layout = layout_for(device_, dtype_, prepack, quantize)
        if self.layout is not None and (layout, device_, dtype_) == (self.layout, self.device, self.dtype):
            return
        self.device, self.dtype = device_, dtype_
        with torch.no_grad():
            for module in self.modules:
                if self.layout is not None:
                    unpack(module)
                module.to(self.device)
                for p in module.parameters():
                    if p.is_floating_point() and p.dtype != self.dtype:
                        p.data = p.data.to(self.dtype)
                if layout is not None:
                    pack(module, layout)
        self.layout = layout

    def use_cpus(self, cpus: int) -> None:
        """The threads torch computes this replica's steps on."""
        torch.set_num_threads(cpus)

    def clone_parameters(self) -> None:
        """Gives this process its own copy of every parameter (a non-COW fork's isolation)."""
        with torch.no_grad():
            for module in self.modules:
                for p in module.parameters():
                    p.data = p.data.clone()
                for layer in module.modules():
                    if isinstance(layer, tuple(LAYOUTS.values())):
                        for name, buffer in list(layer.named_buffers(recurse=False)):
                            setattr(layer, name, buffer.clone())

    @property
    def is_last(self) -> bool:
        return self.last == self.manifest.num_stages

    def validate(self, tensors: dict[str, torch.Tensor], limits: Limits, max_batch: int) -> None:
        self.modules[0].validate(tensors, limits, max_batch)

    @torch.inference_mode()
    def run(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        tensors = {k: v.to(self.device) for k, v in tensors.items()}
        for module in self.modules:
            tensors = module(tensors)
        return {k: v.cpu() for k, v in tensors.items()}

    def checked_run(self, tensors: dict[str, torch.Tensor], limits: Limits) -> dict[str, torch.Tensor]:
        self.validate(tensors, limits, limits.max_inputs)
        out = self.run(tensors)
        if any(t.is_floating_point() and not bool(torch.isfinite(t).all()) for t in out.values()):
            raise BadRequest("the stage produced NaN or infinity", status=422)
        return out
