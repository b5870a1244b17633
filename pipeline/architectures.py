"""How each supported architecture splits into units (embedding, blocks, head) and how a
contiguous range of units runs as one stage, reusing the transformers modules themselves so a
split model computes exactly what the unsplit one does."""
from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM, LlamaModel, PretrainedConfig

from contracts.config import Limits
from contracts.wire import BadRequest, check_size

EMBED, HEAD = "embed", "head"


def unit_names(num_layers: int) -> list[str]:
    return [EMBED] + [f"layer.{i}" for i in range(num_layers)] + [HEAD]


class _Passthrough(nn.Module):
    """Stands in for BERT's embedding module on stages that receive hidden states."""

    def forward(self, inputs_embeds: torch.Tensor | None = None, **_: object) -> torch.Tensor:
        return inputs_embeds


def _config_for_layers(config: PretrainedConfig, num_layers: int) -> PretrainedConfig:
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = num_layers
    cfg._attn_implementation = "sdpa"
    return cfg


class StageModule(nn.Module):
    """Units [first, last) of a model: optional embedding, some blocks, optional head."""

    arch: str

    def __init__(self, config: PretrainedConfig, layer_start: int, layer_end: int,
                 has_embed: bool, has_head: bool) -> None:
        super().__init__()
        self.config = config
        self.layer_start, self.layer_end = layer_start, layer_end
        self.has_embed, self.has_head = has_embed, has_head

    def rename(self, key: str) -> str:
        """Maps a full-model parameter name to this module's name for it."""
        return re.sub(r"(\.layers?\.)(\d+)\.",
                      lambda m: f"{m.group(1)}{int(m.group(2)) - self.layer_start}.", key, count=1)

    def validate(self, tensors: dict[str, torch.Tensor], limits: Limits, max_batch: int) -> None:
        """BadRequest unless the tensors are what this stage takes, in a size `limits` allow."""
        if self.has_embed:
            ids = _require(tensors, "input_ids", (torch.int64, torch.int32), 2)
            check_size(ids, limits, max_batch, self.config.max_position_embeddings)
            if int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size:
                raise BadRequest(f"input_ids out of range 0..{self.config.vocab_size - 1}")
            shape = tuple(ids.shape)
        else:
            hidden = _require(tensors, "hidden", (torch.float32, torch.bfloat16, torch.float16), 3)
            check_size(hidden, limits, max_batch, self.config.max_position_embeddings)
            if hidden.shape[2] != self.config.hidden_size:
                raise BadRequest(f"hidden has width {hidden.shape[2]}; "
                                 f"this stage expects {self.config.hidden_size}")
            if not bool(torch.isfinite(hidden).all()):
                raise BadRequest("tensor 'hidden' contains NaN or infinity")
            shape = tuple(hidden.shape[:2])
        mask = tensors.get("attention_mask")
        if mask is not None:
            _require(tensors, "attention_mask", (torch.int64, torch.int32, torch.bool), 2)
            if tuple(mask.shape) != shape:
                raise BadRequest(f"attention_mask has shape {tuple(mask.shape)}; expected {shape}")
            if not bool(mask.bool().any(dim=1).all()):
                raise BadRequest("attention_mask masks every token of a sequence")


def _require(tensors: dict[str, torch.Tensor], name: str, dtypes: tuple, ndim: int) -> torch.Tensor:
    if name not in tensors:
        raise BadRequest(f"missing tensor {name!r}; got {sorted(tensors)}")
    t = tensors[name]
    if t.dtype not in dtypes:
        raise BadRequest(f"tensor {name!r} has dtype {t.dtype}; allowed {[str(d) for d in dtypes]}")
    if t.dim() != ndim:
        raise BadRequest(f"tensor {name!r} has shape {tuple(t.shape)}; expected {ndim} dimensions")
    return t


def _last_positions(mask: torch.Tensor | None, batch: int, length: int) -> torch.Tensor:
    if mask is None:
        return torch.full((batch,), length - 1, dtype=torch.long)
    # Right padding: the last real token of each row.
    return mask.long().sum(dim=1) - 1


class LlamaStage(StageModule):
    arch = "llama"

    def __init__(self, config: LlamaConfig, layer_start: int, layer_end: int,
                 has_embed: bool, has_head: bool) -> None:
        super().__init__(config, layer_start, layer_end, has_embed, has_head)
        self.model = LlamaModel(_config_for_layers(config, layer_end - layer_start))
        if not has_embed:
            self.model.embed_tokens = None
        if has_head:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        else:
            self.model.norm = nn.Identity()

    def forward(self, tensors: dict[str, torch.Tensor], full_logits: bool = False) -> dict[str, torch.Tensor]:
        mask = tensors.get("attention_mask")
        if mask is not None:
            mask = mask.long()
        if self.has_embed:
            out = self.model(input_ids=tensors["input_ids"].long(), attention_mask=mask)
        else:
            dtype = self.model.norm.weight.dtype if self.has_head else next(self.parameters()).dtype
            out = self.model(inputs_embeds=tensors["hidden"].to(dtype), attention_mask=mask)
        hidden = out.last_hidden_state
        if not self.has_head:
            return _with_mask({"hidden": hidden}, mask)
        if full_logits:
            return {"logits": self.lm_head(hidden).float()}
        rows = torch.arange(hidden.shape[0])
        last = _last_positions(mask, hidden.shape[0], hidden.shape[1])
        return {"logits": self.lm_head(hidden[rows, last]).float()}


class BertStage(StageModule):
    """BERT blocks; its head is sentence-transformers' mean pooling plus L2 normalisation."""

    arch = "bert"

    def __init__(self, config: BertConfig, layer_start: int, layer_end: int,
                 has_embed: bool, has_head: bool) -> None:
        super().__init__(config, layer_start, layer_end, has_embed, has_head)
        self.bert = BertModel(_config_for_layers(config, layer_end - layer_start), add_pooling_layer=False)
        if not has_embed:
            self.bert.embeddings = _Passthrough()

    def rename(self, key: str) -> str:
        return "bert." + super().rename(key)

    def forward(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        mask = tensors.get("attention_mask")
        if mask is not None:
            mask = mask.long()
        if self.has_embed:
            types = tensors.get("token_type_ids")
            out = self.bert(input_ids=tensors["input_ids"].long(), attention_mask=mask,
                            token_type_ids=None if types is None else types.long())
        else:
            dtype = next(self.parameters()).dtype
            out = self.bert(inputs_embeds=tensors["hidden"].to(dtype), attention_mask=mask)
        hidden = out.last_hidden_state
        if not self.has_head:
            return _with_mask({"hidden": hidden}, mask)
        return {"embeddings": mean_pool_normalize(hidden, mask)}


def mean_pool_normalize(hidden: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """sentence-transformers' Pooling(mean) followed by Normalize()."""
    if mask is None:
        mask = torch.ones(hidden.shape[:2], dtype=torch.long)
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    summed = (hidden * weights).sum(dim=1)
    pooled = summed / weights.sum(dim=1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled.float(), p=2, dim=1)


def _with_mask(out: dict[str, torch.Tensor], mask: torch.Tensor | None) -> dict[str, torch.Tensor]:
    if mask is not None:
        out["attention_mask"] = mask
    return out


@dataclass(frozen=True)
class Architecture:
    name: str
    config_class: type[PretrainedConfig]
    stage_class: type[StageModule]
    # Full transformers model used as the unsplit reference.
    reference_class: type[nn.Module]
    unit_of: Callable[[str], str | None]


def _llama_unit(key: str) -> str | None:
    if key.startswith("model.embed_tokens."):
        return EMBED
    m = re.match(r"model\.layers\.(\d+)\.", key)
    if m:
        return f"layer.{m.group(1)}"
    if key.startswith(("model.norm.", "lm_head.")):
        return HEAD
    return None


def _bert_unit(key: str) -> str | None:
    key = key.removeprefix("bert.")
    if key.startswith("embeddings."):
        return EMBED
    m = re.match(r"encoder\.layer\.(\d+)\.", key)
    if m:
        return f"layer.{m.group(1)}"
    return None  # the pooler is not part of sentence-transformers' model


ARCHITECTURES = {
    "llama": Architecture("llama", LlamaConfig, LlamaStage, LlamaForCausalLM, _llama_unit),
    "bert": Architecture("bert", BertConfig, BertStage, BertModel, _bert_unit),
}


def architecture(name: str) -> Architecture:
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise ValueError(f"unknown architecture {name!r}; supported: {sorted(ARCHITECTURES)}") from None
