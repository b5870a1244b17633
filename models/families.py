"""The model families this server splits, by `model_type` (config.json): data only, so that what
checks a checkpoint's family (the gateway, at deploy) starts without torch or transformers."""
from __future__ import annotations

import json
from pathlib import Path

DECODER, ENCODER = "decoder", "encoder"
# Decoders split into embedding, `model.layers.N` and norm plus head; encoders into embeddings and
# `encoder.layer.N`, their head being the sentence pooling.
FAMILIES = {"llama": DECODER, "mistral": DECODER, "qwen2": DECODER, "qwen3": DECODER, "gemma2": DECODER,
            "gemma3_text": DECODER, "phi3": DECODER, "bert": ENCODER, "roberta": ENCODER, "xlm-roberta": ENCODER}


class Unsupported(ValueError):
    """A checkpoint of a family this server does not split."""


def family(model_type: str) -> str:
    """The kind of a model_type; Unsupported naming the supported ones otherwise."""
    try:
        return FAMILIES[model_type]
    except KeyError:
        hint = " (a multimodal Gemma 3: serve its text model, model_type gemma3_text)" if model_type == "gemma3" else ""
        raise Unsupported(f"unsupported model_type {model_type!r}{hint}; supported: {sorted(FAMILIES)}") from None


def check_folder(folder: Path) -> None:
    """Unsupported when a checkpoint folder's config.json names a family this server does not
    split (nothing is said of a folder without one: the partitioner says what it lacks)."""
    config = folder / "config.json"
    if config.is_file():
        family(json.loads(config.read_text()).get("model_type", ""))
