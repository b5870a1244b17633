"""One step of a LLaMA stage over many requests at once, each with its own KV cache (Orca's
selective batching): the tokens of every request in the step, prefills and decodes alike, go
through the projections, norms and MLPs as one flat batch, and only attention runs per request,
against that request's cache. No padding, and a request alone computes exactly what
transformers computes for it (the same modules and kernels on the same shapes)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from pipeline.architectures import LlamaStage
from pipeline.kv_cache import KVShape, Sequence


@dataclass
class Step:
    seq: Sequence
    inputs: torch.Tensor   # token ids [T] on the first stage, hidden states [T, width] after it
    start: int             # the position of inputs[0]; a step of several tokens starts at 0

    @property
    def tokens(self) -> int:
        return int(self.inputs.shape[0])


class BatchedLlama:
    def __init__(self, modules: list[LlamaStage]) -> None:
        first, last = modules[0], modules[-1]
        self.embed = first.model.embed_tokens if first.has_embed else None
        self.layers = [layer for m in modules for layer in m.model.layers]
        self.rotary = first.model.rotary_emb
        self.norm = last.model.norm if last.has_head else None
        self.head = last.lm_head if last.has_head else None
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.groups = attn.num_key_value_groups
        self.kv_heads = attn.k_proj.out_features // attn.head_dim
        self.width = first.config.hidden_size

    def kv_shape(self) -> KVShape:
        p = self.layers[0].self_attn.k_proj.weight
        return KVShape(len(self.layers), self.kv_heads, self.head_dim, p.dtype, p.device)

    @torch.inference_mode()
    def forward(self, steps: list[Step]) -> list[torch.Tensor]:
        """Per step: hidden states [T, width] for the next stage, or, on the last stage, the
        logits of its last position [vocab] (float32)."""
        for s in steps:
            if s.tokens > 1 and s.start != 0:
                raise ValueError("a step of several tokens must start at position 0 (a prefill)")
            if s.start + s.tokens > s.seq.capacity:
                raise ValueError(f"sequence {s.seq.seq_id} is full ({s.seq.capacity} positions)")
        x = self._inputs(steps)
        positions = torch.cat([torch.arange(s.start, s.start + s.tokens) for s in steps]).unsqueeze(0).to(x.device)
        cos, sin = self.rotary(x, positions)
        spans = _spans(steps)
        for index, layer in enumerate(self.layers):
            x = x + self._attention(index, layer, layer.input_layernorm(x), cos, sin, steps, spans)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        for s in steps:
            s.seq.length = s.start + s.tokens
        if self.head is None:
            return [x[0, a:b] for a, b in spans]
        last = x[0, [b - 1 for _, b in spans]]
        logits = self.head(self.norm(last.unsqueeze(0)))[0].float()
        return list(logits)

    def _inputs(self, steps: list[Step]) -> torch.Tensor:
        if self.embed is not None:
            return self.embed(torch.cat([s.inputs.long() for s in steps]).unsqueeze(0))
        dtype = self.layers[0].input_layernorm.weight.dtype
        return torch.cat([s.inputs for s in steps]).unsqueeze(0).to(dtype)

    def _attention(self, index: int, layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   steps: list[Step], spans: list[tuple[int, int]]) -> torch.Tensor:
        attn = layer.self_attn
        shape = (1, h.shape[1], -1, self.head_dim)
        q = attn.q_proj(h).view(shape).transpose(1, 2)
        k = attn.k_proj(h).view(shape).transpose(1, 2)
        v = attn.v_proj(h).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        outs = []
        for s, (a, b) in zip(steps, spans):
            end = s.start + s.tokens
            keys, values = s.seq.keys[index], s.seq.values[index]
            keys[:, :, s.start:end] = k[:, :, a:b]
            values[:, :, s.start:end] = v[:, :, a:b]
            outs.append(F.scaled_dot_product_attention(
                q[:, :, a:b], keys[:, :, :end], values[:, :, :end], scale=attn.scaling,
                is_causal=s.tokens > 1, enable_gqa=self.groups > 1))
        out = torch.cat(outs, dim=2).transpose(1, 2).reshape(1, h.shape[1], -1)
        return attn.o_proj(out)


def _spans(steps: list[Step]) -> list[tuple[int, int]]:
    spans, at = [], 0
    for s in steps:
        spans.append((at, at + s.tokens))
        at += s.tokens
    return spans
