"""QUART_COMPILE the way a user turns it on: a user's own decoder (LLaMA-shaped, random weights
written by transformers' save_pretrained) in two stages on the embedded runtime with decode steps
compiled. The replicas serve eagerly while they compile, then their records say the decode steps
ran compiled, and the tokens, alone and batched, are the unsplit model's."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from transformers import AutoTokenizer

from contracts.http_client import GatewayClient
from models.architectures import architecture
from models.random_checkpoint import write_random_checkpoint
from runtime.ports import free_port
from state.store import RedisStore
from tests.live.runtime_helpers import STACK_HEAD, greedy_reference
from tools import stack as stack_tool

MODEL, NEW = "my-llama", 12
TEXTS = ["a cat sits on the mat", "one two three four five six", "pipelines"]


@pytest.fixture(scope="module")
def compiled(home_settings, tmp_path_factory):
    """(settings, checkpoint folder) of the runtime serving the model with QUART_COMPILE on."""
    from runtime import __main__ as control
    root = tmp_path_factory.mktemp("compiled")
    cache = home_settings.models_dir / "_sources"
    folder = write_random_checkpoint("llama", cache, {"num_hidden_layers": 4}, seed=13)
    stack = root / "stack.yml"
    stack.write_text(STACK_HEAD)
    stack_tool.add(stack, MODEL, str(folder), 2, cache)
    # float32, so the tokens can be compared with transformers' own float32 model exactly.
    settings = home_settings.replace(
        home=str(root / "home"), gateway_port=free_port(), redis_port=free_port(), keysmanager_port=free_port(),
        stack_file=str(stack), request_timeout_s=120.0, admit_wait_s=0.0, compile=True, dtype="float32")
    try:
        assert control.up(settings, timeout=600) == 0, "the runtime did not come up"
        yield settings, folder
    finally:
        control.down(settings)


def _generate(client: GatewayClient, text: str) -> dict:
    reply = client.invoke(MODEL, {"prompt": text, "max_new_tokens": NEW, "ignore_eos": True})
    assert reply.status == 200, reply.body
    return reply.json()


def _decode_records(store: RedisStore, rid: str, since: float) -> list[list[bool]]:
    """Per stage, whether each of the request's decode steps ran compiled."""
    return [[s.compiled for s in store.samples(MODEL, stage, since)
             if s.kind == "decode" and s.request_id.startswith(rid + ".")] for stage in range(2)]


def test_decode_steps_compile_in_the_background_and_answer_as_the_unsplit_model(compiled):
    settings, folder = compiled
    client, store = GatewayClient(settings.gateway.url, timeout=120), RedisStore.from_url(settings.redis_url)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    reference = architecture("llama").reference(folder)
    expected = {t: greedy_reference(reference, tokenizer(t)["input_ids"], NEW)[0] for t in TEXTS}
    # Answered while the replicas compile (eager steps), and after.
    deadline, ran = time.monotonic() + 900, []
    while True:
        since = time.time() - 1.0
        reply = _generate(client, TEXTS[0])
        assert reply["token_ids"] == expected[TEXTS[0]]
        ran = _decode_records(store, reply["id"], since)
        if all(r and all(r) for r in ran):
            break
        assert time.monotonic() < deadline, f"decode steps still eager after 900 s: {ran}"
        time.sleep(2.0)
    since = time.time() - 1.0
    with ThreadPoolExecutor(len(TEXTS)) as pool:
        replies = list(pool.map(lambda t: _generate(client, t), TEXTS))
    for text, reply in zip(TEXTS, replies):
        assert reply["token_ids"] == expected[text], text
        assert all(r and all(r) for r in _decode_records(store, reply["id"], since)), text
