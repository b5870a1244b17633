"""The stages on a GPU (QUART_DEVICE=cuda), run where one is present and skipped elsewhere: a
split decoder whose stages were loaded on the CPU and moved (as a replica forked from a zygote
moves) generates on CUDA what the unsplit model loaded there does, in each dtype; float32 on CUDA
agrees with float32 on the CPU; a seed samples the same token from CUDA logits as from the same
logits on the CPU; decode steps run no cuDNN attention (it builds a plan per new length); and
the embedded runtime serving with QUART_DEVICE=cuda answers like the unsplit model, its replicas
holding GPU memory."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from contracts.http_client import GatewayClient
from models.batched_decoder import BatchedDecoder
from models.partition import partition
from models.sampling import Sampling, sample
from models.sources import resolve
from models.stage_runner import StageRunner
from runtime.ports import free_port
from tests.live.runtime_helpers import STACK_HEAD, greedy_reference
from tests.live.test_families import NEW, PROMPT, greedy_cached
from tools import stack as stack_tool

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")

# Same kernels on both sides of the split, float32 without TF32: equal to rounding; bfloat16 to its
# rounding of each layer's output.
TOLERANCE = {"float32": 1e-4, "bfloat16": 0.1}
TEXT = "The capital of France is"


@pytest.fixture(scope="module")
def checkpoint(home_settings):
    return resolve("random-llama", home_settings.models_dir / "_sources", seed=1)


def moved_chain(manifest, dtype: str) -> list[BatchedDecoder]:
    """Each stage loaded on the CPU, then moved to CUDA: what a replica forked from a zygote does."""
    chain = []
    for i in range(manifest.num_stages):
        runner = StageRunner(manifest, i, i + 1, device="cpu", dtype=dtype)
        runner.to("cuda", dtype)
        chain.append(BatchedDecoder(runner.modules))
    return chain


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_split_moved_to_cuda_generates_what_the_unsplit_model_there_does(dtype, checkpoint, tmp_path):
    split = moved_chain(partition(checkpoint, 4, tmp_path / "split"), dtype)
    whole = [BatchedDecoder(StageRunner(partition(checkpoint, 1, tmp_path / "whole"), 0, 1, device="cuda",
                                        dtype=dtype).modules)]
    assert all(e.kv_shape().device.type == "cuda" and e.dtype == getattr(torch, dtype) for e in split)
    got, got_logits = greedy_cached(split, PROMPT, NEW)  # prompt tensors start on the CPU, as decoded
    expected, logits = greedy_cached(whole, PROMPT, NEW)
    assert got_logits.device.type == "cuda"
    assert got == expected
    assert (got_logits - logits).abs().max().item() <= TOLERANCE[dtype]


def test_decode_steps_on_cuda_keep_off_cudnn_attention(checkpoint, tmp_path):
    """cuDNN's attention builds a plan for every new key length, i.e. on every decode step of a new
    sequence (40-130 ms of CPU per stage on an H100); the stages' steps run none of its kernels."""
    chain = moved_chain(partition(checkpoint, 2, tmp_path / "two"), "bfloat16")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        greedy_cached(chain, PROMPT, NEW)
        torch.cuda.synchronize()
    names = [e.key for e in prof.key_averages()]
    assert names, "the profiler saw no CUDA kernel"
    assert not [n for n in names if "cudnn" in n.lower()], names


def test_float32_on_cuda_agrees_with_float32_on_the_cpu(checkpoint, tmp_path):
    manifest = partition(checkpoint, 2, tmp_path / "two")
    on_cpu = [BatchedDecoder(StageRunner(manifest, i, i + 1, dtype="float32").modules) for i in range(2)]
    got, got_logits = greedy_cached(moved_chain(manifest, "float32"), PROMPT, NEW)
    expected, logits = greedy_cached(on_cpu, PROMPT, NEW)
    assert got == expected
    assert (got_logits.cpu() - logits).abs().max().item() <= 1e-3


def test_a_seed_samples_the_same_token_from_cuda_logits_as_from_cpu_logits():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(3)) * 4
    for seed in range(5):
        sampling = Sampling(temperature=0.8, top_p=0.9, seed=seed, logprobs=2)
        on_gpu, on_cpu = sample(logits.cuda(), sampling, 7), sample(logits, sampling, 7)
        assert on_gpu.keys() == on_cpu.keys()
        for key in on_cpu:
            assert on_gpu[key].device.type == "cpu"
            torch.testing.assert_close(on_gpu[key], on_cpu[key])


def test_the_runtime_serves_on_cuda_like_the_unsplit_model(home_settings, checkpoint, tmp_path):
    """Two stages of a random LLaMA, replicas forked from the KeysManager's zygotes (loaded on the
    CPU) and moved to the GPU; greedy tokens equal the unsplit float32 model's on the CPU."""
    from runtime import __main__ as control
    stack = tmp_path / "stack.yml"
    stack.write_text(STACK_HEAD)
    stack_tool.add(stack, "gpu-llama", str(checkpoint.folder), 2, home_settings.models_dir / "_sources")
    settings = home_settings.replace(
        home=str(tmp_path / "home"), gateway_port=free_port(), redis_port=free_port(), keysmanager_port=free_port(),
        stack_file=str(stack), policy="none", request_timeout_s=120.0, admit_wait_s=0.0, device="cuda",
        dtype="float32")
    free_before, _ = torch.cuda.mem_get_info()
    try:
        assert control.up(settings, timeout=180) == 0, "the runtime did not come up on CUDA"
        client = GatewayClient.for_settings(settings)
        reply = client.invoke("gpu-llama", {"prompt": TEXT, "max_new_tokens": NEW, "ignore_eos": True})
        assert reply.status == 200, reply.body
        free_after, _ = torch.cuda.mem_get_info()
    finally:
        control.down(settings)
    ids = AutoTokenizer.from_pretrained(checkpoint.folder)(TEXT)["input_ids"]
    expected, _ = greedy_reference(checkpoint.arch.reference(checkpoint.folder), ids, NEW)
    assert reply.json()["token_ids"] == expected
    # Each stage replica holds a CUDA context and its parameters (a context alone is hundreds of MB).
    assert free_before - free_after >= 2 * 100 * 2**20
