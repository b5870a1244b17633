"""A user's own models, the way a user serves them: checkpoints in folders (a Gemma-2-shaped
decoder and a RoBERTa-shaped sentence encoder, random weights written by transformers'
save_pretrained, the decoder sharded), `python -m tools.stack add` into a stack file, `python -m
runtime up` with the default policy (which partitions them and profiles their CPU law once), and
OpenAI's own client on the gateway's one `/v1` base URL."""
from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
import torch

from models.architectures import architecture, pool
from models.random_checkpoint import write_random_checkpoint
from runtime.ports import free_port
from tests.live.runtime_helpers import STACK_HEAD, greedy_reference
from tools import stack as stack_tool


@pytest.fixture(scope="module")
def own(home_settings, tmp_path_factory):
    """The runtime serving the two models from their folders; (settings, decoder folder, encoder folder)."""
    from runtime import __main__ as control
    root = tmp_path_factory.mktemp("own")
    cache = home_settings.models_dir / "_sources"
    decoder = write_random_checkpoint("gemma2", cache, {"num_hidden_layers": 6}, seed=7, max_shard_size="20MB")
    encoder = write_random_checkpoint("roberta", cache, seed=7)
    stack = root / "stack.yml"
    stack.write_text(STACK_HEAD)
    stack_tool.add(stack, "my-gemma", str(decoder), 3, cache)
    stack_tool.add(stack, "my-encoder", str(encoder), 2, cache)
    settings = home_settings.replace(
        home=str(root / "home"), gateway_port=free_port(), redis_port=free_port(), keysmanager_port=free_port(),
        stack_file=str(stack), request_timeout_s=60.0, admit_wait_s=0.0)
    try:
        assert control.up(settings, timeout=600) == 0, "the runtime did not come up with the user's models"
        yield settings, decoder, encoder
    finally:
        control.down(settings)


@pytest.fixture(scope="module")
def oai(own) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{own[0].gateway.url}/v1", api_key="unused", max_retries=0)


def test_the_stack_names_the_sources_and_the_partitions_follow_them(own):
    settings, decoder, _ = own
    text = Path(settings.stack_file).read_text()
    assert f'QUART_MODEL_SOURCE: "{decoder}"' in text and "my-gemma-s2:" in text
    manifest = json.loads((settings.models_dir / "my-gemma" / "manifest.json").read_text())
    assert manifest["arch"] == "gemma2" and len(manifest["stages"]) == 3 and manifest["source"] == str(decoder)
    assert (Path(settings.home) / "my-gemma.cpu_fits.json").is_file()  # profiled once by `up`


def test_one_base_url_lists_every_model_with_its_context(oai):
    cards = {m.id: m for m in oai.models.list().data}
    assert sorted(cards) == ["my-encoder", "my-gemma"]
    assert cards["my-gemma"].max_model_len == 2048


def test_what_a_common_client_sends_is_answered_like_the_unsplit_model(oai, own):
    _, decoder, _ = own
    messages = [{"role": "developer", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    chat = oai.chat.completions.create(model="my-gemma", messages=messages, logprobs=False, max_tokens=256,
                                       temperature=0, extra_body={"ignore_eos": True, "some_framework_field": 1})
    assert chat.usage.completion_tokens == 256 and chat.choices[0].finish_reason == "length"
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(decoder)
    mapped = [{"role": "system", "content": "You are terse."}, messages[1]]
    ids = list(tokenizer.apply_chat_template(mapped, add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"])
    expected, _ = greedy_reference(architecture("gemma2").reference(decoder), ids, 12)
    assert chat.usage.prompt_tokens == len(ids)
    assert chat.choices[0].message.content.startswith(tokenizer.decode(expected, skip_special_tokens=True))


def test_embeddings_through_the_openai_client(oai, own):
    _, _, encoder = own
    texts = ["a cat sits on the mat", "pipelines"]
    got = oai.embeddings.create(model="my-encoder", input=texts)  # the client asks for base64
    assert [d.index for d in got.data] == [0, 1] and got.usage.prompt_tokens > 0
    from transformers import AutoTokenizer
    enc = AutoTokenizer.from_pretrained(encoder)(texts, padding=True, return_tensors="pt")
    with torch.inference_mode():
        hidden = architecture("roberta").reference(encoder)(**enc).last_hidden_state
    expected = pool(hidden, enc["attention_mask"])
    assert (torch.tensor([d.embedding for d in got.data]) - expected).abs().max().item() <= 1e-5
    floats = oai.embeddings.create(model="my-encoder", input="pipelines", encoding_format="float")
    assert torch.allclose(torch.tensor(floats.data[0].embedding), expected[1], atol=1e-5)


def test_routing_errors_are_openai_shaped(oai):
    with pytest.raises(openai.NotFoundError) as missing:
        oai.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    assert "my-gemma" in str(missing.value)
    with pytest.raises(openai.NotFoundError) as wrong:
        oai.embeddings.create(model="my-gemma", input="x")
    assert "generates text" in str(wrong.value)
    with pytest.raises(openai.BadRequestError) as long:
        oai.completions.create(model="my-gemma", prompt="x", max_tokens=4096)
    assert "max_tokens" in str(long.value)


def test_a_deployment_of_an_unsupported_family_is_a_400_naming_the_supported(own, tmp_path):
    from contracts.http_client import GatewayClient
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    deployment = {"service": "my-gpt2-s0", "image": "quart/stage:0.1.0",
                  "envVars": {"QUART_MODEL": "my-gpt2", "QUART_STAGES": "0", "QUART_MODEL_SOURCE": str(tmp_path)}}
    reply = GatewayClient.for_settings(own[0]).request("POST", "/system/functions", json.dumps(deployment).encode())
    assert reply.status == 400 and "gpt2" in reply.json()["error"] and "qwen2" in reply.json()["error"]


def test_streams_completions_logprobs_and_choices_through_the_one_base_url(oai):
    """The gateway relays server-sent events as they come, for any model behind /v1."""
    pieces, usage = {}, None
    for part in oai.chat.completions.create(model="my-gemma", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=6, temperature=0.9, seed=5, n=2, stream=True,
                                            logprobs=True, top_logprobs=2, stream_options={"include_usage": True}):
        for c in part.choices:
            pieces.setdefault(c.index, []).extend(c.logprobs.content if c.logprobs else [])
        usage = part.usage or usage
    assert sorted(pieces) == [0, 1] and usage.completion_tokens == sum(len(v) for v in pieces.values())
    assert all(len(t.top_logprobs) == 2 for v in pieces.values() for t in v)
    done = oai.completions.create(model="my-gemma", prompt="One, two,", max_tokens=4, temperature=0, logprobs=1,
                                  extra_body={"ignore_eos": True})
    assert len(done.choices[0].logprobs.token_logprobs) == 4 and done.usage.completion_tokens == 4
