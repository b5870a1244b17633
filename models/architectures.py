"""The model families this server splits, and how a contiguous range of units (the embedding,
transformer blocks, the head) runs as one stage. A stage reuses the family's own transformers
modules (embedding, decoder or encoder layers, norms, rotary embeddings), built for its range of
layers, so a split model computes what the unsplit one does, with each family's quirks (q/k/v
bias, q/k norms, fused projections, sliding windows, soft-capping, scaled embeddings, tied heads)
handled where transformers handles them. Only attention is this project's own
(`models/decoder_attention.py`): it runs against this server's KV cache."""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass

import torch
from torch import nn
from transformers import CONFIG_MAPPING, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING

from contracts.config import Limits
from contracts.wire import BadRequest, check_size
from models.decoder_attention import ATTENTION
from models.families import DECODER, family

EMBED, HEAD = "embed", "head"


def config_from_dict(model_type: str, data: dict) -> PretrainedConfig:
    family(model_type)
    return CONFIG_MAPPING[model_type].from_dict({k: v for k, v in data.items() if k != "model_type"})


def unit_names(num_layers: int) -> list[str]:
    return [EMBED] + [f"layer.{i}" for i in range(num_layers)] + [HEAD]


_COMPUTED = (".position_ids", ".inv_freq")
_DECODER_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_ENCODER_LAYER = re.compile(r"encoder\.layer\.(\d+)\.")


def unit_of(model_type: str, key: str) -> str | None:
    """The unit a checkpoint tensor belongs to; None for tensors no stage uses (BERT's pooler, and
    buffers that older checkpoints carry and transformers computes: position ids, rotary
    frequencies)."""
    if key.endswith(_COMPUTED):
        return None
    if family(model_type) == DECODER:
        if key.startswith("model.embed_tokens."):
            return EMBED
        m = _DECODER_LAYER.match(key)
        if m:
            return f"layer.{m.group(1)}"
        return HEAD if key.startswith(("model.norm.", "lm_head.")) else None
    key = _strip_prefix(key)
    if key.startswith("embeddings."):
        return EMBED
    m = _ENCODER_LAYER.match(key)
    return f"layer.{m.group(1)}" if m else None


def _strip_prefix(key: str) -> str:
    """An encoder's tensor name without its base-model prefix (`bert.`, `roberta.`), which some
    checkpoints carry and sentence-transformers' do not."""
    head, _, rest = key.partition(".")
    return rest if head in ("bert", "roberta", "model") and rest else key


def stage_config(config: PretrainedConfig, layer_start: int, layer_end: int) -> PretrainedConfig:
    """The family's config for a model of only blocks [layer_start, layer_end): per-layer settings
    (sliding or full attention) cut to that range, and this project's attention."""
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = layer_end - layer_start
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = list(config.layer_types[layer_start:layer_end])
    cfg._attn_implementation = ATTENTION if family(cfg.model_type) == DECODER else "sdpa"
    return cfg


class StageModule(nn.Module):
    """Units [first, last) of a model: optional embedding, some blocks, optional head."""

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


class DecoderStage(StageModule):
    """Blocks of a decoder-only model: the family's base model (`Qwen2Model`, ...) built for this
    range, without the embedding where another stage embeds and without the final norm where
    another stage ends, plus the head on the last stage. It runs through `BatchedDecoder`."""

    def __init__(self, config: PretrainedConfig, layer_start: int, layer_end: int,
                 has_embed: bool, has_head: bool) -> None:
        super().__init__(config, layer_start, layer_end, has_embed, has_head)
        cfg = stage_config(config, layer_start, layer_end)
        self.model = MODEL_MAPPING[type(config)](cfg)
        if not has_embed:
            self.model.embed_tokens = None
        if has_head:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        else:
            self.model.norm = None
        self._engine = None

    def forward(self, tensors: dict[str, torch.Tensor], full_logits: bool = False) -> dict[str, torch.Tensor]:
        """A padded batch ([B, T], right padding) without a KV cache: each row a prefill of its own.
        Per row, hidden states for the next stage, or the logits of its last position (of every
        position with `full_logits`)."""
        from models.batched_decoder import BatchedDecoder, run_rows
        if self._engine is None:
            self._engine = BatchedDecoder([self])
        return run_rows(self._engine, tensors, full_logits)


class EncoderStage(StageModule):
    """Blocks of a BERT-like encoder; its head is the sentence pooling the checkpoint's
    sentence-transformers files name (mean or CLS, normalised or not)."""

    def __init__(self, config: PretrainedConfig, layer_start: int, layer_end: int,
                 has_embed: bool, has_head: bool, pooling: dict | None = None) -> None:
        super().__init__(config, layer_start, layer_end, has_embed, has_head)
        self.encoder = MODEL_MAPPING[type(config)](stage_config(config, layer_start, layer_end),
                                                   add_pooling_layer=False)
        if not has_embed:
            self.encoder.embeddings = _Passthrough()
        self.pooling = pooling or {"mode": "mean", "normalize": True}

    def rename(self, key: str) -> str:
        return "encoder." + super().rename(_strip_prefix(key))

    def forward(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        mask = tensors.get("attention_mask")
        if mask is not None:
            mask = mask.long()
        if self.has_embed:
            types = tensors.get("token_type_ids")
            out = self.encoder(input_ids=tensors["input_ids"].long(), attention_mask=mask,
                               token_type_ids=None if types is None else types.long())
        else:
            dtype = next(self.parameters()).dtype
            out = self.encoder(inputs_embeds=tensors["hidden"].to(dtype), attention_mask=mask)
        hidden = out.last_hidden_state
        if not self.has_head:
            return {"hidden": hidden, **({"attention_mask": mask} if mask is not None else {})}
        return {"embeddings": pool(hidden, mask, **self.pooling)}


class _Passthrough(nn.Module):
    """Stands in for an encoder's embeddings on stages that receive hidden states."""

    def forward(self, inputs_embeds: torch.Tensor | None = None, **_: object) -> torch.Tensor:
        return inputs_embeds


def pool(hidden: torch.Tensor, mask: torch.Tensor | None, mode: str = "mean", normalize: bool = True) -> torch.Tensor:
    """sentence-transformers' Pooling (mean over real tokens, or the first token) and, when the
    checkpoint has it, Normalize()."""
    if mode == "cls":
        pooled = hidden[:, 0].float()
    else:
        if mask is None:
            mask = torch.ones(hidden.shape[:2], dtype=torch.long)
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        pooled = ((hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)).float()
    return torch.nn.functional.normalize(pooled, p=2, dim=1) if normalize else pooled


def mean_pool_normalize(hidden: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return pool(hidden, mask, "mean", True)


@dataclass(frozen=True)
class Architecture:
    model_type: str
    kind: str

    @property
    def generative(self) -> bool:
        return self.kind == DECODER

    def stage(self, config: PretrainedConfig, layers: tuple[int, int], has_embed: bool, has_head: bool,
              pooling: dict | None = None) -> StageModule:
        if self.generative:
            return DecoderStage(config, *layers, has_embed, has_head)
        return EncoderStage(config, *layers, has_embed, has_head, pooling)

    def reference(self, folder, dtype: torch.dtype = torch.float32) -> nn.Module:
        """The unsplit transformers model of a checkpoint folder, the one a split must equal."""
        config = config_from_dict(self.model_type, _read_config(folder))
        cls = (MODEL_FOR_CAUSAL_LM_MAPPING if self.generative else MODEL_MAPPING)[type(config)]
        kwargs = {} if self.generative else {"add_pooling_layer": False}
        # Soft-capped attention is eager's alone among transformers' own implementations.
        attn = "eager" if getattr(config, "attn_logit_softcapping", None) else "sdpa"
        return cls.from_pretrained(folder, dtype=dtype, attn_implementation=attn, **kwargs).eval()


def _read_config(folder) -> dict:
    import json
    from pathlib import Path
    return json.loads((Path(folder) / "config.json").read_text())


def architecture(model_type: str) -> Architecture:
    return Architecture(model_type, family(model_type))
