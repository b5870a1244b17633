"""The last stage sends a generation's next decode step to the first stage itself
(QUART_CHAIN_STEPS): the entry sends only the prefill, gets the unsplit model's tokens, and no
step runs past the sequence's room or a stop token. Real SmolLM2 stage replicas (in this
process, each with its own threads), a real redis-server, and the entry's own pipeline client."""
from __future__ import annotations

import asyncio
import time

import pytest
import redis

from contracts.stage import StageRef
from engine.replica import StageReplica
from frontend.pipeline_client import PipelineClient, Progress
from models.sampling import Sampling
from state.store import RedisStore
from tests.live.runtime_helpers import greedy_reference, wait_until

NEW_TOKENS = 8
STAGES = 4


@pytest.fixture(scope="module")
def pipeline(home_settings, partitioned, tmp_path_factory, module_redis_port):
    """Settings on a redis-server of their own, and one replica per stage (stopped after)."""
    partitioned("smollm2", STAGES)
    settings = home_settings.replace(home=str(tmp_path_factory.mktemp("chain")), models=str(home_settings.models_dir),
                                     redis_port=module_redis_port, server="chain-test", threads=1)
    replicas = [StageReplica(settings, StageRef("smollm2", k, k + 1)) for k in range(STAGES)]
    for replica in replicas:
        replica.start()
    try:
        yield settings, replicas
    finally:
        for replica in replicas:
            replica.stop()


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    return tokenizer("The capital of France is")["input_ids"]


@pytest.fixture(scope="module")
def expected(sources, prompt) -> list[int]:
    return greedy_reference(sources["smollm2"].model, prompt, NEW_TOKENS)[0]


def run(settings, request_id: str, prompt: list[int], stop_tokens=(), take: int = NEW_TOKENS):
    """Generates with the entry's client, taking at most `take` tokens (then closing, as the entry
    does on a stop), and counts the messages the entry itself sent to the stages."""
    async def go() -> tuple[list[int], int, PipelineClient]:
        client = PipelineClient(settings, "smollm2", f"{request_id}-entry")
        sent = 0
        xadd = client._sender.xadd

        async def counted(*args):
            nonlocal sent
            sent += 1
            return await xadd(*args)
        client._sender.xadd = counted
        tokens = client.generate(request_id, prompt, NEW_TOKENS, Sampling(), time.time() + 120, Progress(),
                                 stop_tokens=stop_tokens)
        got = []
        async for token in tokens:
            got.append(token)
            if len(got) == take or token in stop_tokens:
                break
        await tokens.aclose()
        await client.aclose()  # the frees reach the holders
        return got, sent, client
    return asyncio.run(go())


def steps_of(settings, request_id: str, stage: int) -> list[str]:
    """The kinds of the steps `stage` ran for `request_id`, from its records."""
    store = RedisStore(redis.Redis.from_url(settings.redis_url))
    return [x.kind for x in store.samples("smollm2", stage) if x.request_id.split(".")[0] == request_id]


def settled(settings, replicas, request_id: str) -> None:
    """Waits until every replica freed the request's sequence, then a moment more for a step that
    would still be under way."""
    wait_until(lambda: not any(r.generation.store.sequences for r in replicas), 20, f"{request_id}'s caches freed")
    time.sleep(0.5)


def test_the_entry_sends_only_the_prefill_and_gets_the_unsplit_models_tokens(pipeline, prompt, expected):
    settings, replicas = pipeline
    got, sent, client = run(settings, "chained", prompt)
    settled(settings, replicas, "chained")
    assert got == expected
    assert sent == 1, f"the entry sent {sent} messages; the last stage should have sent every decode step"
    # The sequence holds prompt + 8 tokens: no step past the eighth token.
    assert steps_of(settings, "chained", STAGES - 1) == ["prefill"] + ["decode"] * (NEW_TOKENS - 1)
    assert not client._pending

    unchained, sent, _ = run(settings.replace(chain_steps=False), "unchained", prompt)
    assert unchained == expected and sent == NEW_TOKENS


def test_no_step_follows_a_stop_token(pipeline, prompt, expected):
    settings, replicas = pipeline
    k = next(i for i in range(2, NEW_TOKENS) if expected[i] not in expected[:i])  # its first occurrence
    got, sent, client = run(settings, "stopped", prompt, stop_tokens={expected[k]})
    settled(settings, replicas, "stopped")
    assert got == expected[:k + 1] and sent == 1
    assert steps_of(settings, "stopped", 0) == ["prefill"] + ["decode"] * k
    assert not client._pending


def test_a_generation_closed_early_runs_at_most_one_step_more_and_frees_its_caches(pipeline, prompt, expected):
    settings, replicas = pipeline
    got, _, client = run(settings, "closed", prompt, take=3)
    settled(settings, replicas, "closed")
    assert got == expected[:3]
    # Token 3 came from the second decode step; the third was under way when the client closed.
    assert len(steps_of(settings, "closed", 0)) in (3, 4)
    assert not client._pending
