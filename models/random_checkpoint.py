"""Checkpoints with random weights of any supported family, written by transformers' own config
classes and save_pretrained: the same files a real checkpoint of that family has, so the real
loading, partitioning and serving code runs on them without a hub. Decoders take the bundled
SmolLM2's tokenizer (and its vocabulary size), encoders MiniLM's."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch

from models.architectures import config_from_dict
from models.families import DECODER, family

# Small by default (a test writes one in a second); every size can be overridden.
DECODER_SIZES = {"hidden_size": 128, "num_hidden_layers": 4, "intermediate_size": 256, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "max_position_embeddings": 2048}
ENCODER_SIZES = {"hidden_size": 96, "num_hidden_layers": 4, "intermediate_size": 192, "num_attention_heads": 4,
                 "max_position_embeddings": 514}
# Each family's quirks switched on at sizes a short prompt reaches: sliding windows shorter than
# the tests' prompts, soft-capping, tied heads, attention bias.
QUIRKS = {
    "mistral": {"sliding_window": 6},
    "qwen2": {"use_sliding_window": False},
    "qwen3": {"head_dim": 48, "tie_word_embeddings": True},  # Qwen 3 decouples head_dim from the width
    "gemma2": {"head_dim": 32, "sliding_window": 6, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
               "query_pre_attn_scalar": 32},
    "gemma3_text": {"head_dim": 32, "sliding_window": 6, "sliding_window_pattern": 2, "query_pre_attn_scalar": 32,
                    "layer_types": None},
    "phi3": {"partial_rotary_factor": 0.5},
}


def tokenizer_source(model_type: str, cache: Path) -> Path:
    from models.sources import bundled_dir
    return bundled_dir("smollm2" if family(model_type) == DECODER else "minilm", cache)


def random_config(model_type: str, cache: Path, overrides: dict) -> dict:
    """config.json's content: the family's defaults at small sizes, its quirks, the tokenizer's
    vocabulary and special tokens, then `overrides`."""
    tokenizer_config = json.loads((tokenizer_source(model_type, cache) / "config.json").read_text())
    decoder = family(model_type) == DECODER
    data = {**(DECODER_SIZES if decoder else ENCODER_SIZES), **QUIRKS.get(model_type, {})}
    for key in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id"):
        data[key] = tokenizer_config.get(key)
    data.update(overrides)
    if data.get("layer_types") is None:
        data.pop("layer_types", None)
    if model_type == "gemma3_text" and "layer_types" not in data:
        pattern = data.pop("sliding_window_pattern")
        data["layer_types"] = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                               for i in range(data["num_hidden_layers"])]
    data.pop("sliding_window_pattern", None)
    return data


def write_random_checkpoint(model_type: str, cache: Path, overrides: dict | None = None, seed: int = 0,
                            dtype: str = "float32", max_shard_size: str | None = None) -> Path:
    """<cache>/random-<model_type>-<digest>: config, safetensors and tokenizer; written once."""
    from transformers import AutoTokenizer
    overrides = overrides or {}
    key = json.dumps([model_type, overrides, seed, dtype, max_shard_size], sort_keys=True)
    folder = cache / f"random-{model_type}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"
    if (folder / "config.json").is_file():
        return folder
    config = config_from_dict(model_type, random_config(model_type, cache, overrides))
    torch.manual_seed(seed)
    model = _model_class(config)(config).to(getattr(torch, dtype)).eval()
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    AutoTokenizer.from_pretrained(tokenizer_source(model_type, cache)).save_pretrained(tmp)
    if family(model_type) != DECODER:  # sentence-transformers' files: mean pooling, normalised
        pooling = tokenizer_source(model_type, cache)
        shutil.copy(pooling / "modules.json", tmp / "modules.json")
        shutil.copytree(pooling / "1_Pooling", tmp / "1_Pooling")
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


def _model_class(config):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING
    if family(config.model_type) == DECODER:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    return MODEL_MAPPING[type(config)]
