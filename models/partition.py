"""Partition a model into S pipeline stages: one safetensors shard per stage plus a manifest.

    python -m models.partition --model smollm2 --stages 4
    python -m models.partition --model ~/models/Qwen2.5-0.5B-Instruct --name qwen --stages 4
    python -m models.partition --model random-qwen2 --stages 8 \
        --random-config '{"hidden_size": 2048, "num_hidden_layers": 24, "intermediate_size": 5632}'

`--model` is a source (models/sources.py): a folder, a hub id, a bundled model or
random-<model_type>. Stage boundaries come from DeepSpeed's `partition_balanced` over the units'
byte sizes (units: the embedding, each transformer block, the head), or are uniform over blocks
on request.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import shutil
import sys
from pathlib import Path

from safetensors.torch import save_file

from contracts.config import add_arguments, exit_on_config_error, settings_from_args
from models.architectures import EMBED, HEAD, unit_names, unit_of
from models.manifest import FORMAT, Manifest, StageInfo, file_hashes
from models.sources import Checkpoint, resolve


def unit_tensors(ckpt: Checkpoint) -> tuple[list[str], dict[str, list[str]]]:
    """Unit names and, per unit, the checkpoint tensors it holds (read from the files' headers)."""
    names = unit_names(ckpt.num_layers)
    keys: dict[str, list[str]] = {name: [] for name in names}
    for key in ckpt.files:
        unit = unit_of(ckpt.model_type, key)
        if unit is not None:
            keys[unit].append(key)
    return names, keys


def unit_bytes(ckpt: Checkpoint, names: list[str], keys: dict[str, list[str]]) -> list[int]:
    counts = [sum(ckpt.nbytes(k) for k in keys[n]) for n in names]
    if _tied_head(ckpt, keys):
        counts[-1] += ckpt.nbytes(TIED_SOURCE)
    return counts


TIED_SOURCE, TIED_HEAD = "model.embed_tokens.weight", "lm_head.weight"


def _tied_head(ckpt: Checkpoint, keys: dict[str, list[str]]) -> bool:
    """A decoder whose head is its embedding (SmolLM2, Gemma, Qwen3's small models): the head's
    stage gets its own copy, as each stage owns its shard."""
    return ckpt.arch.generative and TIED_HEAD not in keys[HEAD]


def balanced_bounds(counts: list[int], stages: int) -> list[int]:
    """Contiguous stages whose byte sizes are as even as possible: the linear-partition dynamic
    programme that DeepSpeed's `partition_balanced` runs (stage j ending at unit i extends the
    best split of the units before it, judged by the spread between its heaviest and lightest
    stage, a tie going to the later boundary), so the same checkpoint splits the same way it
    always has. Written here because DeepSpeed ships only a source archive that compiles against
    torch, a heavy dependency of every image for these lines."""
    n = len(counts)
    prefix = list(itertools.accumulate(counts, initial=0))
    # best[j][i]: (spread, heaviest, lightest, boundary) of the best split of units [0, i) into j stages.
    best = [[(math.inf, math.inf, math.inf, 0)] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = (0, 0, math.inf, 0)
    for i in range(1, n + 1):
        for j in range(1, min(i, stages) + 1):
            for k in range(i):
                size = prefix[i] - prefix[k]
                _, heaviest, lightest, _ = best[j - 1][k]
                heaviest, lightest = max(heaviest, size), min(lightest, size)
                if heaviest - lightest <= best[j][i][0]:
                    best[j][i] = (heaviest - lightest, heaviest, lightest, k)
    bounds = [n]
    for j in range(stages, 0, -1):
        bounds.append(best[j][bounds[-1]][3])
    return bounds[::-1]


def uniform_bounds(num_units: int, stages: int) -> list[int]:
    """Blocks split evenly; the embedding goes with the first stage and the head with the last."""
    blocks = num_units - 2
    bounds = [0] + [1 + (blocks * i) // stages for i in range(1, stages)] + [num_units]
    return bounds


def stage_bounds(counts: list[int], stages: int, method: str) -> list[int]:
    if not 1 <= stages <= len(counts):
        raise ValueError(f"cannot split {len(counts)} units into {stages} stages")
    bounds = uniform_bounds(len(counts), stages) if method == "uniform" else balanced_bounds(counts, stages)
    if any(b >= e for b, e in zip(bounds, bounds[1:])):
        raise ValueError(f"partition {bounds} leaves a stage empty; use fewer stages")
    return bounds


def partition(ckpt: Checkpoint, stages: int, out: Path, method: str = "balanced") -> Manifest:
    """Writes one safetensors shard per stage, its byte size balanced (or its blocks uniform),
    reading only that stage's tensors from the checkpoint: the model is never in memory whole."""
    names, keys = unit_tensors(ckpt)
    counts = unit_bytes(ckpt, names, keys)
    bounds = stage_bounds(counts, stages, method)
    tied = _tied_head(ckpt, keys)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    infos = []
    for index, (a, b) in enumerate(zip(bounds, bounds[1:])):
        units = names[a:b]
        state = dict(ckpt.tensors([k for u in units for k in keys[u]]))
        if tied and HEAD in units:
            state[TIED_HEAD] = next(ckpt.tensors([TIED_SOURCE]))[1]
        state = {k: v.contiguous() for k, v in state.items()}
        shard = f"stage-{index:02d}.safetensors"
        save_file(state, str(tmp / shard))
        (tmp / shard).chmod(0o644)  # safetensors writes 0600; an image's replicas run as another user
        blocks = [int(u.split(".")[1]) for u in units if u.startswith("layer.")]
        first_block = blocks[0] if blocks else _blocks_before(names, a)
        sha256, pieces = file_hashes(tmp / shard)
        infos.append(StageInfo(
            index=index, units=(a, b), layers=(first_block, first_block + len(blocks)),
            has_embed=EMBED in units, has_head=HEAD in units, params=sum(t.numel() for t in state.values()),
            shard=shard, sha256=sha256, bytes=(tmp / shard).stat().st_size, pieces=pieces))
        del state
    _copy_tokenizer(ckpt.folder, tmp / "tokenizer")
    manifest = Manifest(
        model=out.name, arch=ckpt.model_type, source=ckpt.name, method=method, dtype=ckpt.dtype,
        config=ckpt.config, tokenizer="tokenizer", units=[{"name": n, "bytes": c} for n, c in zip(names, counts)],
        stages=infos, directory=tmp, pooling=ckpt.pooling(), format=FORMAT)
    manifest.save()
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    manifest.directory = out
    return manifest


def ensure_partitioned(models_dir: Path, name: str, stages: int, source: str | None = None,
                       method: str = "balanced", random_config: dict | None = None) -> Manifest:
    """The partition <models_dir>/<name> of `source` (default: `name`) into `stages` stages by
    `method`, made only if it is not there yet (or was made of another source)."""
    out = models_dir / name
    source = source or name
    try:
        manifest = Manifest.load(out)
        if (manifest.num_stages, manifest.method, manifest.source, manifest.format) == (stages, method, source, FORMAT):
            return manifest
    except FileNotFoundError:
        pass
    ckpt = resolve(source, models_dir / "_sources", random_config)
    print(f"partitioning {name} ({ckpt.model_type}, {ckpt.folder}) into {stages} stages ...", flush=True)
    return partition(ckpt, stages, out, method)


def _blocks_before(names: list[str], unit: int) -> int:
    return sum(1 for n in names[:unit] if n.startswith("layer."))


def _copy_tokenizer(source_dir: Path, target: Path) -> None:
    from transformers import AutoTokenizer
    AutoTokenizer.from_pretrained(source_dir).save_pretrained(target)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True,
                        help="a checkpoint folder, a hub id, smollm2, minilm or random-<model_type>")
    parser.add_argument("--stages", type=int, required=True)
    parser.add_argument("--uniform", action="store_true", help="split blocks evenly instead of by parameters")
    parser.add_argument("--name", help="name of the partitioned model (default: the source's last part)")
    parser.add_argument("--out", type=Path, help="output directory (default: <home>/models/<name>)")
    parser.add_argument("--random-config", default="{}", help="JSON config overrides for random-<model_type>")
    parser.add_argument("--seed", type=int, default=0)
    add_arguments(parser, "home")
    args = parser.parse_args(argv)
    settings = exit_on_config_error(lambda: settings_from_args(args))
    out = args.out or settings.models_dir / (args.name or Path(args.model).name.lower())
    try:
        ckpt = resolve(args.model, settings.models_dir / "_sources", json.loads(args.random_config), args.seed)
        manifest = partition(ckpt, args.stages, out, "uniform" if args.uniform else "balanced")
    except (ValueError, FileNotFoundError) as exc:
        print(f"partition: {exc}", file=sys.stderr)
        return 2
    for s in manifest.stages:
        print(f"stage {s.index}: units {s.units} layers {s.layers} params {s.params:,} "
              f"{s.bytes / 1e6:.1f} MB {s.sha256[:12]}")
    print(f"wrote {manifest.directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
