"""Partitioning: boundaries, manifests and shards."""
from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from models.manifest import Manifest, sha256_file
from models.stage_runner import StageRunner


def test_manifest_describes_its_shards(partitioned):
    manifest = partitioned("smollm2", 4)
    stages = manifest.stages
    assert stages[0].has_embed and stages[-1].has_head
    assert stages[0].units[0] == 0 and stages[-1].units[1] == len(manifest.units)
    for a, b in zip(stages, stages[1:]):
        assert a.units[1] == b.units[0] and a.layers[1] == b.layers[0]
    assert stages[-1].layers[1] == manifest.config["num_hidden_layers"] == 30
    assert sum(u["bytes"] for u in manifest.units) == 4 * sum(s.params for s in stages)  # float32
    for s in stages:
        path = manifest.shard_path(s.index)
        assert sha256_file(path) == s.sha256 and path.stat().st_size == s.bytes
        with safe_open(str(path), "pt") as f:
            assert sum(_numel(f.get_slice(k).get_shape()) for k in f.keys()) == s.params
    assert (manifest.tokenizer_path() / "tokenizer.json").is_file()


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def test_a_changed_shard_is_refused(partitioned, tmp_path):
    manifest = partitioned("minilm", 3)
    data = json.loads((manifest.directory / "manifest.json").read_text())
    data["stages"][1]["sha256"] = "0" * 64
    copy = tmp_path / "minilm"
    copy.mkdir()
    (copy / "manifest.json").write_text(json.dumps(data))
    for s in manifest.stages:
        (copy / s.shard).symlink_to(manifest.shard_path(s.index))
    with pytest.raises(ValueError, match="sha256"):
        StageRunner(Manifest.load(copy), 1, 2)
