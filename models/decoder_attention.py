"""Attention against this server's KV cache, registered with transformers' AttentionInterface so
every decoder family's own attention module (its projections, q/k norms, rotary embedding, bias)
runs unchanged and calls this for the one part that differs: a step holds several requests
flattened into one row, and each attends only to its own cache.

Written here rather than taken from transformers: its attention functions read keys and values
from its own `Cache` object, one batch row per sequence, which is the padding and copying that
Orca's selective batching avoids."""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface

ATTENTION = "quart"

# cuDNN's attention comes first in torch's order on recent GPUs, and it builds an execution plan
# for every new shape: a decode step's keys are one position longer each step, so every step of a
# new sequence paid that build (40-130 ms of CPU per 4-layer stage on an H100, against 4-6 ms
# where the lengths had been seen). Flash attention has no per-shape set-up.
_GPU_KERNELS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def kernels(device: torch.device) -> AbstractContextManager:
    """The attention kernels a step may use on `device`, for the length of one step."""
    return sdpa_kernel(_GPU_KERNELS) if device.type == "cuda" else nullcontext()


@dataclass
class LayerCall:
    """What one layer's attention needs to know of the step: which cache layer it writes, and
    each sequence's slice of the flattened tokens (Step objects of `models/batched_decoder.py`)."""
    layer: int
    steps: list
    spans: list[tuple[int, int]]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scaling: float,
           window: int | None, softcap: float | None) -> torch.Tensor:
    """Queries at positions start.. (q: [1, heads, T, d]) over keys at 0.. (k, v: [1, kv, L, d]),
    causal, within a sliding window where the layer has one, logits soft-capped where the family
    caps them; [1, heads, T, d]."""
    if q.device.type == "cpu" and q.dtype != torch.float32:
        # torch's CPU attention in 16 bits is several times slower than in float32 on the same
        # values, copies included (a bfloat16 decode step over 1,000 cached positions: 985 µs,
        # 169 µs upcast), and float32 scores are what transformers' eager attention computes.
        out = attend(q.float(), k.float(), v.float(), start, scaling, window, softcap)
        return out.to(q.dtype)
    tokens, length = q.shape[2], k.shape[2]
    groups = q.shape[1] // k.shape[1]
    if window is not None and tokens == 1 and length > window:
        k, v = k[:, :, length - window:], v[:, :, length - window:]
        window = None
    mask = None
    if tokens > 1 and start == 0 and length == tokens and window is None and softcap is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=groups > 1)
    if tokens > 1 or window is not None:
        qpos = torch.arange(start, start + tokens, device=q.device).unsqueeze(1)
        kpos = torch.arange(k.shape[2], device=q.device).unsqueeze(0)
        mask = kpos <= qpos
        if window is not None:
            mask &= kpos > qpos - window
    return _masked(q, k, v, mask, scaling, softcap)


@dataclass
class PagedCall:
    """What one layer's attention needs in a compiled decode step (`models/compiled_decode.py`):
    B sequences of one new token each, as tensors only, so one compiled function serves every
    batch. `write`: each row's slot for its new position [B]; `read`: the slots of positions
    0..L-1 of each row [B, L] (L the batch's longest length rounded up, padded with any valid
    slot); `masks`: per sliding window (None: the full context), which of those each row sees
    [B, 1, 1, L]; the layer pools of `models/kv_cache.py`."""
    layer: int
    write: torch.Tensor
    read: torch.Tensor
    masks: dict[int | None, torch.Tensor]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, call: PagedCall,
                    scaling: float, window: int | None, softcap: float | None) -> torch.Tensor:
    """query [B, heads, 1, d], key and value [B, kv_heads, 1, d] of each row's new position;
    writes them to the pools, attends over each row's keys; [B, 1, heads, d]."""
    keys, values = call.keys[call.layer], call.values[call.layer]
    keys.index_copy_(0, call.write, key[:, :, 0].to(keys.dtype))
    values.index_copy_(0, call.write, value[:, :, 0].to(values.dtype))
    k, v = keys[call.read].transpose(1, 2), values[call.read].transpose(1, 2)
    mask = call.masks[window]
    if query.device.type == "cpu" and query.dtype != torch.float32:  # as `attend`, and for its reason
        out = _masked(query.float(), k.float(), v.float(), mask, scaling, softcap).to(query.dtype)
    else:
        out = _masked(query, k, v, mask, scaling, softcap)
    return out.transpose(1, 2)


def _masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scaling: float,
            softcap: float | None) -> torch.Tensor:
    """Attention of q over the keys `mask` lets it see (all where None), logits soft-capped where
    `softcap` says."""
    groups = q.shape[1] // k.shape[1]
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=groups > 1)
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.tanh(torch.matmul(q, k.transpose(2, 3)) * scaling / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def cached_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None,
                     sliding_window: int | None = None, softcap: float | None = None,
                     quart: LayerCall | PagedCall | None = None, **_: object) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [1, heads, T, d], key and value
    [1, kv_heads, T, d] for the step's new tokens; returns [1, T, heads, d]. (A compiled decode
    step's batch of one-token rows instead: [B, heads, 1, d] in, [B, 1, heads, d] out.)"""
    if quart is None:
        raise RuntimeError("this model's layers run through models.batched_decoder.BatchedDecoder")
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    if isinstance(quart, PagedCall):
        return paged_attention(query, key, value, quart, scaling, sliding_window, softcap), None
    outs = []
    for s, (a, b) in zip(quart.steps, quart.spans):
        end = s.start + s.tokens
        s.seq.store.write(s.seq, quart.layer, s.start, key[:, :, a:b], value[:, :, a:b])
        keys, values = s.seq.store.read(s.seq, quart.layer, end)
        outs.append(attend(query[:, :, a:b], keys, values, s.start, scaling, sliding_window, softcap))
    return torch.cat(outs, dim=2).transpose(1, 2), None


AttentionInterface.register(ATTENTION, cached_attention)
