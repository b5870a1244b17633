"""Low precision and prepacked weights compute what they should: in each dtype the split model
generates what the unsplit one does in that dtype, prepacked linears what `F.linear` does, and a
bfloat16 model stays close to transformers' own bfloat16 model (real SmolLM2 weights)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import AutoTokenizer

from models.batched_decoder import BatchedDecoder
from models.packed_linear import Int8Linear, PackedLinear, can_pack
from models.precision import bf16_native
from models.stage_runner import StageRunner
from tests.live.test_families import greedy_cached

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
NEW = 16


def chain(manifest, dtype: str, prepack: bool = True) -> list[BatchedDecoder]:
    return [BatchedDecoder(StageRunner(manifest, i, i + 1, dtype=dtype, prepack=prepack).modules)
            for i in range(manifest.num_stages)]


@pytest.fixture(scope="module")
def prompts(partitioned):
    tokenizer = AutoTokenizer.from_pretrained(partitioned("smollm2", 4).tokenizer_path())
    return [tokenizer(p)["input_ids"] for p in PROMPTS]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_split_generates_what_the_unsplit_model_does_in_the_same_dtype(dtype, partitioned, prompts):
    split, whole = chain(partitioned("smollm2", 4), dtype), chain(partitioned("smollm2", 1), dtype)
    assert split[0].dtype == getattr(torch, dtype) == split[0].kv_shape().dtype
    for ids in prompts:
        got, got_logits = greedy_cached(split, ids, NEW)
        expected, logits = greedy_cached(whole, ids, NEW)
        assert got == expected
        torch.testing.assert_close(got_logits, logits)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prepacked_weights_generate_what_plain_linears_do(dtype, partitioned, prompts):
    if not can_pack(torch.device("cpu"), getattr(torch, dtype)):
        pytest.skip(f"oneDNN does not pack {dtype} on this CPU")
    manifest = partitioned("smollm2", 4)
    packed, plain = chain(manifest, dtype), chain(manifest, dtype, prepack=False)
    assert any(isinstance(m, PackedLinear) for m in packed[1].layers[0].modules())
    assert not any(isinstance(m, PackedLinear) for e in plain for layer in e.layers for m in layer.modules())
    for ids in prompts:
        got, got_logits = greedy_cached(packed, ids, NEW)
        expected, logits = greedy_cached(plain, ids, NEW)
        assert got == expected
        # The same products summed in another order: float32 to 1e-5 of the logits, bfloat16 to
        # its rounding of the layers' outputs.
        tolerance = 5e-4 if dtype == "float32" else 0.5
        assert (got_logits - logits).abs().max().item() <= tolerance


def test_bfloat16_stays_close_to_transformers_in_bfloat16(sources, partitioned, prompts):
    """Not equal: transformers' bfloat16 attention rounds where this project's computes in float32."""
    reference = copy.deepcopy(sources["smollm2"].model).to(torch.bfloat16)
    split = chain(partitioned("smollm2", 4), "bfloat16")
    for ids in prompts:
        with torch.inference_mode():
            expected = reference(input_ids=torch.tensor([ids])).logits[0, -1].float()
        _, got = greedy_cached(split, ids, 1)
        assert int(got.argmax()) == int(expected.argmax())
        assert (got - expected).abs().max().item() <= 1.0  # logits reach about 20


def test_a_runner_moved_to_another_dtype_or_layout_computes_as_one_made_so(partitioned, prompts):
    """The whole model in one runner (embedding, blocks and head), run once before each move."""
    manifest = partitioned("smollm2", 1)
    ids = {"input_ids": torch.tensor([prompts[0]])}
    runner = StageRunner(manifest, 0, 1, dtype="float32")
    packed = runner.run(ids)["logits"]
    runner.to("cpu", "float32", prepack=False)
    assert any(type(m) is nn.Linear for m in runner.modules[0].modules())
    assert not any(isinstance(m, PackedLinear) for m in runner.modules[0].modules())
    torch.testing.assert_close(runner.run(ids)["logits"], packed, rtol=1e-4, atol=5e-4)
    runner.to("cpu", "bfloat16")
    assert all(m.packed.dtype == torch.bfloat16 for m in runner.modules[0].modules() if isinstance(m, PackedLinear))
    assert torch.equal(runner.run(ids)["logits"], StageRunner(manifest, 0, 1, dtype="bfloat16").run(ids)["logits"])


def test_auto_serves_bfloat16_where_this_cpu_computes_it(partitioned):
    runner = StageRunner(partitioned("smollm2", 4), 0, 1)
    assert runner.dtype == (torch.bfloat16 if bf16_native("cpu") else torch.float32)


def test_int8_weights_split_as_the_unsplit_model_and_stay_close_to_float32(partitioned, prompts):
    """QUART_QUANTIZE=int8: the split equals the unsplit model quantized the same way; against
    float32 the first token agrees and the logits move by about 1 of about 20 (measured: at most
    1.4 on these prompts)."""
    def int8(manifest):
        return [BatchedDecoder(StageRunner(manifest, i, i + 1, dtype="bfloat16", quantize="int8").modules)
                for i in range(manifest.num_stages)]
    split, whole = int8(partitioned("smollm2", 4)), int8(partitioned("smollm2", 1))
    assert all(isinstance(m, Int8Linear) for m in split[1].layers[0].mlp.modules() if "Linear" in type(m).__name__)
    reference = chain(partitioned("smollm2", 4), "float32")
    for ids in prompts:
        got, logits = greedy_cached(split, ids, NEW)
        assert got == greedy_cached(whole, ids, NEW)[0]
        _, expected = greedy_cached(reference, ids, 1)
        assert int(logits.argmax()) == int(expected.argmax())
        assert (logits.float() - expected).abs().max().item() <= 2.0
