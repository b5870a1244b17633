"""A split model computes what the unsplit transformers model computes (real weights, float32)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from models.architectures import mean_pool_normalize
from models.stage_runner import StageRunner

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
# Logits reach about 20; float32 GEMMs that block their sums differently (oneDNN's prepacked
# weights here, `F.linear` in transformers) agree to about 1e-5 of that, a wrong split or a
# bfloat16 step is off by tenths.
TOLERANCE = 5e-4


def run_chain(manifest, tensors, **kwargs):
    """Runs every stage in turn, each in its own runner, as separate replicas would."""
    runners = [StageRunner(manifest, i, i + 1, dtype="float32") for i in range(manifest.num_stages)]
    for runner in runners[:-1]:
        tensors = runner.run(tensors)
    with torch.inference_mode():
        return runners[-1].modules[0](tensors, **kwargs)


def greedy_split(manifest, ids: list[int], max_new: int, eos: int) -> list[int]:
    runners = [StageRunner(manifest, i, i + 1, dtype="float32") for i in range(manifest.num_stages)]
    new: list[int] = []
    for _ in range(max_new):
        tensors = {"input_ids": torch.tensor([ids + new])}
        for runner in runners:
            tensors = runner.run(tensors)
        new.append(int(tensors["logits"][0].argmax()))
        if new[-1] == eos:
            break
    return new


@pytest.mark.parametrize("stages", [1, 4, 8])
def test_smollm2_logits_match(stages, sources, partitioned):
    manifest = partitioned("smollm2", stages)
    tokenizer = AutoTokenizer.from_pretrained(manifest.tokenizer_path())
    reference = sources["smollm2"].model
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.inference_mode():
            expected = reference(input_ids=ids).logits
        got = run_chain(manifest, {"input_ids": ids}, full_logits=True)["logits"]
        assert got.shape == expected.shape
        assert (got - expected).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("stages", [4, 8])
def test_smollm2_greedy_text_matches(stages, sources, partitioned):
    manifest = partitioned("smollm2", stages)
    tokenizer = AutoTokenizer.from_pretrained(manifest.tokenizer_path())
    reference = sources["smollm2"].model
    eos = reference.config.eos_token_id
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        with torch.inference_mode():
            out = reference.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                     eos_token_id=eos, pad_token_id=eos)
        expected = out[0, len(ids):].tolist()
        got = greedy_split(manifest, ids, 12, eos)
        assert got == expected, (prompt, tokenizer.decode(got), tokenizer.decode(expected))


def test_balanced_and_uniform_splits_agree(partitioned):
    balanced, uniform = partitioned("smollm2", 4), partitioned("smollm2", 4, "uniform")
    assert [s.units for s in balanced.stages] != [s.units for s in uniform.stages]
    ids = torch.tensor([[1, 504, 2988, 314, 42]])
    a = run_chain(balanced, {"input_ids": ids})["logits"]
    b = run_chain(uniform, {"input_ids": ids})["logits"]
    assert (a - b).abs().max().item() <= TOLERANCE


def test_minilm_embeddings_match(sources, partitioned):
    manifest = partitioned("minilm", 3)
    tokenizer = AutoTokenizer.from_pretrained(manifest.tokenizer_path())
    texts = ["hello world", "A much longer sentence about serving pipelined models on functions.", "x"]
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.inference_mode():
        hidden = sources["minilm"].model(**enc).last_hidden_state
    expected = mean_pool_normalize(hidden, enc["attention_mask"])
    got = run_chain(manifest, dict(enc))["embeddings"]
    assert (got - expected).abs().max().item() <= TOLERANCE
    assert torch.allclose(got.norm(dim=1), torch.ones(len(texts)), atol=1e-5)


RANDOM_CONFIGS = {
    "random-llama": {"hidden_size": 128, "num_hidden_layers": 5, "intermediate_size": 256,
                     "num_attention_heads": 4, "num_key_value_heads": 2},
    "random-bert": {"hidden_size": 96, "num_hidden_layers": 4, "intermediate_size": 192, "num_attention_heads": 4},
}


@pytest.mark.parametrize("name", sorted(RANDOM_CONFIGS))
def test_random_weight_models_of_any_size_split_exactly(name, home_settings, tmp_path):
    from models.partition import partition
    from models.sources import load_source
    source = load_source(name, home_settings.models_dir / "_sources", RANDOM_CONFIGS[name], seed=3)
    assert source.model.config.hidden_size == RANDOM_CONFIGS[name]["hidden_size"]
    manifest = partition(source.checkpoint, 3, tmp_path / name)
    ids = torch.tensor([[5, 17, 300, 42, 7, 99]])
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        if name == "random-llama":
            expected = source.model(input_ids=ids).logits
            got = run_chain(manifest, {"input_ids": ids}, full_logits=True)["logits"]
        else:
            expected = mean_pool_normalize(source.model(input_ids=ids, attention_mask=mask).last_hidden_state, mask)
            got = run_chain(manifest, {"input_ids": ids, "attention_mask": mask})["embeddings"]
    assert (got - expected).abs().max().item() <= TOLERANCE


def test_bf16_stages_on_request(partitioned):
    """bf16 is an approximation: the same greedy token as float32 on a clear-cut prompt."""
    manifest = partitioned("smollm2", 4)
    ids = torch.tensor([[504, 3575, 282, 4649, 314]])  # "The capital of France is"
    tensors32, tensors16 = {"input_ids": ids}, {"input_ids": ids}
    for i in range(manifest.num_stages):
        tensors32 = StageRunner(manifest, i, i + 1, dtype="float32").run(tensors32)
        runner = StageRunner(manifest, i, i + 1, dtype="bfloat16")
        assert all(p.dtype == torch.bfloat16 for p in runner.modules[0].parameters())
        tensors16 = runner.run(tensors16)
        if "hidden" in tensors16:
            assert tensors16["hidden"].dtype == torch.bfloat16
    assert int(tensors16["logits"].argmax()) == int(tensors32["logits"].argmax())


def test_consolidated_replica_runs_a_stage_range(partitioned):
    """One runner over stages [1, 3) equals stages 1 and 2 run one after the other."""
    manifest = partitioned("smollm2", 4)
    hidden = StageRunner(manifest, 0, 1, dtype="float32").run({"input_ids": torch.tensor([[1, 2, 3, 4]])})
    both = StageRunner(manifest, 1, 3, dtype="float32").run(hidden)
    step = StageRunner(manifest, 2, 3, dtype="float32").run(StageRunner(manifest, 1, 2, dtype="float32").run(hidden))
    assert torch.equal(both["hidden"], step["hidden"])
