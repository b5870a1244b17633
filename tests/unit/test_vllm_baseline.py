"""The vLLM-CPU baseline's checkpoint: vLLM reads a Hugging Face layout whose config names its
architecture, which the project's converted checkpoints need not; the weights are the same files."""
from __future__ import annotations

import json

from benchmarks.vllm_cpu import checkpoint


def test_the_baseline_reads_the_same_weights_with_its_architecture_named(tmp_path):
    weights, tokenizer = tmp_path / "ckpt", tmp_path / "tok"
    weights.mkdir()
    tokenizer.mkdir()
    (weights / "model.safetensors").write_bytes(b"weights")
    (weights / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    (tokenizer / "tokenizer.json").write_text("{}")
    (tokenizer / "config.json").write_text(json.dumps({"model_type": "other"}))
    out = checkpoint(weights, tokenizer, "LlamaForCausalLM", tmp_path / "root")
    assert (out / "model.safetensors").resolve() == (weights / "model.safetensors").resolve()
    assert (out / "tokenizer.json").read_text() == "{}"
    config = json.loads((out / "config.json").read_text())
    assert config == {"model_type": "llama", "hidden_size": 8, "architectures": ["LlamaForCausalLM"]}
    # A config that names its architecture keeps it; a second call changes nothing.
    (weights / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["MistralForCausalLM"]}))
    again = checkpoint(weights, tokenizer, "LlamaForCausalLM", tmp_path / "root")
    assert again == out and json.loads((out / "config.json").read_text())["architectures"] == ["MistralForCausalLM"]
