"""One step of a decoder stage over many requests at once, each with its own KV cache (Orca's
selective batching): the tokens of every request in the step, prefills and decodes alike, go
through the family's own decoder layers (projections, norms, MLPs) as one flat batch, and only
attention runs per request, against that request's cache (`models/decoder_attention.py`). No
padding, and a request alone computes exactly what transformers computes for it."""
from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from models.decoder_attention import LayerCall, kernels
from models.kv_cache import KVShape, KVStore, Sequence


@dataclass
class Step:
    seq: Sequence
    inputs: torch.Tensor   # token ids [T] on the first stage, hidden states [T, width] after it
    start: int             # the position of inputs[0]; a step of several tokens starts at 0

    @property
    def tokens(self) -> int:
        return int(self.inputs.shape[0])


class BatchedDecoder:
    def __init__(self, modules: list) -> None:
        """`modules`: consecutive DecoderStage modules (one replica's range of stages)."""
        first, last = modules[0], modules[-1]
        self.embed = first.model.embed_tokens if first.has_embed else None
        # Per module: its rotary embedding (and whether it rotates per kind of layer, read once
        # here rather than on every step), and its layers with their kind (sliding or full).
        self.blocks = [(m.model.rotary_emb, _per_kind(m.model.rotary_emb), list(m.model.layers), _layer_types(m))
                       for m in modules]
        self.layers = [layer for _, _, layers, _ in self.blocks for layer in layers]
        self.norm = last.model.norm if last.has_head else None
        self._last = last
        self.softcap = getattr(first.config, "final_logit_softcapping", None)
        self.width = first.config.hidden_size
        self.kv_heads = first.config.num_key_value_heads
        # A stage may hold no blocks (a large vocabulary's embedding alone): its cache is empty.
        self.head_dim = self.layers[0].self_attn.head_dim if self.layers else 0
        # Held, not copied: a replica's runner may change its parameters' dtype after this is built.
        self._weight = next(first.parameters())
        # Decode-only steps through a compiled function, once one is ready (`models/compiled_decode.py`).
        self.compiled = None

    @property
    def head(self) -> torch.nn.Module | None:
        """Read from the module on each use: a runner moved to another dtype or layout replaces
        its linear layers (`models/packed_linear.py`)."""
        return self._last.lm_head if self._last.has_head else None

    @property
    def dtype(self) -> torch.dtype:
        return self._weight.dtype

    def kv_shape(self) -> KVShape:
        p = self._weight
        return KVShape(len(self.layers), self.kv_heads, self.head_dim, p.dtype, p.device)

    @torch.inference_mode()
    def forward(self, steps: list[Step], all_positions: bool = False, compiled: bool | None = None) -> list[torch.Tensor]:
        """Per step: hidden states [T, width] for the next stage, or, on the last stage, the
        logits of its last position [vocab] (of every position [T, vocab] with `all_positions`;
        float32). `compiled`: whether through the compiled decode step, as `runs_compiled` said
        (asked here where not given)."""
        for s in steps:
            if s.tokens > 1 and s.start != 0:
                raise ValueError("a step of several tokens must start at position 0 (a prefill)")
            if s.start + s.tokens > s.seq.capacity:
                raise ValueError(f"sequence {s.seq.seq_id} is full ({s.seq.capacity} positions)")
        if compiled is None:
            compiled = not all_positions and self.runs_compiled(steps)
        if compiled:
            return self.compiled.forward(steps)
        x = self._inputs(steps)
        positions = torch.cat([torch.arange(s.start, s.start + s.tokens) for s in steps]).unsqueeze(0).to(x.device)
        spans = _spans(steps)
        with kernels(x.device):
            x = self.layers_forward(x, positions, lambda index: LayerCall(index, steps, spans))
        for s in steps:
            s.seq.length = s.start + s.tokens
        if self.head is None:
            return [x[0, a:b] for a, b in spans]
        if all_positions:
            return [self.logits(x[:, a:b])[0] for a, b in spans]
        return list(self.logits(x[:, [b - 1 for _, b in spans]])[0])

    def runs_compiled(self, steps: list[Step]) -> bool:
        """Whether `forward` runs these steps through the compiled decode step."""
        return self.compiled is not None and self.compiled.serves(steps)

    def layers_forward(self, x: torch.Tensor, positions: torch.Tensor, call: Callable[[int], object]) -> torch.Tensor:
        """The decoder layers over hidden states x at `positions`; `call(i)` is what the i-th
        layer's attention is given (`models/decoder_attention.py`)."""
        index = 0
        for rotary, per_kind, layers, kinds in self.blocks:
            embeddings = _position_embeddings(rotary, per_kind, x, positions, kinds)
            for layer, kind in zip(layers, kinds):
                out = layer(x, position_embeddings=embeddings[kind], attention_mask=None, position_ids=positions,
                            quart=call(index))
                x = out[0] if isinstance(out, tuple) else out
                index += 1
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.norm(hidden)).float()
        if self.softcap:  # Gemma 2 and 3 cap their logits as their ForCausalLM does
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def _inputs(self, steps: list[Step]) -> torch.Tensor:
        """The steps' inputs as one flat batch on the parameters' device (they arrive on the CPU,
        decoded from the stream)."""
        device = self._weight.device
        if self.embed is not None:
            return self.embed(torch.cat([s.inputs.long() for s in steps]).unsqueeze(0).to(device))
        return torch.cat([s.inputs for s in steps]).unsqueeze(0).to(device, self.dtype)


def _layer_types(module) -> list[str | None]:
    types = getattr(module.model.config, "layer_types", None)
    return list(types) if types else [None] * len(module.model.layers)


def _per_kind(rotary) -> bool:
    """Whether a rotary embedding takes the kind of layer: Gemma 3 rotates local and global layers
    at different bases."""
    return "layer_type" in inspect.signature(rotary.forward).parameters


def _position_embeddings(rotary, per_kind: bool, x: torch.Tensor, positions: torch.Tensor,
                         kinds: list[str | None]) -> dict[str | None, tuple[torch.Tensor, torch.Tensor]]:
    """cos and sin per kind of layer."""
    if per_kind:
        return {kind: rotary(x, positions, kind) for kind in set(kinds)}
    shared = rotary(x, positions)
    return {kind: shared for kind in set(kinds)}


def _spans(steps: list[Step]) -> list[tuple[int, int]]:
    spans, at = [], 0
    for s in steps:
        spans.append((at, at + s.tokens))
        at += s.tokens
    return spans


def run_rows(engine: BatchedDecoder, tensors: dict[str, torch.Tensor], full_logits: bool) -> dict[str, torch.Tensor]:
    """A padded batch ([B, T], right padding, optional attention_mask) without a KV cache: each
    row a prefill of its own in a cache that lasts this call. Hidden states [B, T, width] (padded
    positions zero) with the mask; or logits [B, vocab] of each row's last real position
    ([B, T, vocab] with `full_logits`)."""
    inputs = tensors["input_ids"] if engine.embed is not None else tensors["hidden"]
    mask = tensors.get("attention_mask")
    lengths = [int(n) for n in (mask.long().sum(dim=1) if mask is not None else [inputs.shape[1]] * inputs.shape[0])]
    store = KVStore(engine.kv_shape(), budget_bytes=engine.kv_shape().bytes_per_token * sum(lengths))
    steps = [Step(store.admit(str(i), n), inputs[i, :n], 0) for i, n in enumerate(lengths)]
    outs = engine.forward(steps, all_positions=full_logits)
    if engine.head is not None and not full_logits:
        return {"logits": torch.stack(outs)}
    padded = torch.zeros(inputs.shape[0], inputs.shape[1], *outs[0].shape[1:], dtype=outs[0].dtype, device=outs[0].device)
    for i, (out, n) in enumerate(zip(outs, lengths)):
        padded[i, :n] = out
    if engine.head is not None:
        return {"logits": padded}
    return {"hidden": padded, **({"attention_mask": mask} if mask is not None else {})}
