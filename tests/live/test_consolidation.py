"""The layout controller on a runtime of its own (real SmolLM2, the QUART autoscaler running, a
whole-model function beside the four stage functions): warm and quiet, the model consolidates
into one whole replica and its stage functions go to zero; a burst splits it back into the stage
functions and the whole replica goes. Every request is answered, with the unsplit model's tokens."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from autoscaler.policy.layout import PIPELINED, WHOLE
from contracts import keys
from contracts.http_client import GatewayClient
from contracts.paths import REPO_ROOT
from contracts.stack import consolidating_stack, scale_to_zero_stack
from runtime import __main__ as control
from runtime.ports import free_port
from tests.live.runtime_helpers import reference_greedy, wait_until

PROMPT = "The capital of France is"
NARROW = [f"smollm2-s{i}" for i in range(4)]


@pytest.fixture(scope="module")
def consolidating(home_settings, partitioned, tmp_path_factory):
    partitioned("smollm2", 4)
    home = tmp_path_factory.mktemp("layout")
    # The stage functions also scale to zero when idle (15 m): at zero for the layout, they stay there.
    stack = scale_to_zero_stack(consolidating_stack(REPO_ROOT / "stack.yml", home / "whole.yml", "smollm2"),
                                home / "stack.yml", "smollm2", "15m")
    settings = home_settings.replace(
        home=str(home), models=str(home_settings.models_dir), stack_file=str(stack),
        gateway_port=free_port(), redis_port=free_port(), keysmanager_port=free_port(), cache_stages="none",
        request_timeout_s=120.0, admit_wait_s=0.0, r_min=1, max_batch=4, layout_window_s=2.0, layout_windows=3)
    try:
        assert control.up(settings, timeout=600) == 0
        yield settings
    finally:
        control.down(settings)


def replicas(client: GatewayClient) -> dict[str, int]:
    return {f["name"]: f["availableReplicas"] for f in client.functions() if f["name"].startswith("smollm2-")}


def layout(r: redis.Redis) -> str:
    return (r.get(keys.layout("smollm2")) or PIPELINED.encode()).decode()


def test_a_quiet_model_consolidates_and_a_burst_splits_it(consolidating, sources, tokenizer):
    client = GatewayClient.for_settings(consolidating)
    r = redis.Redis.from_url(consolidating.redis_url)
    expected = tokenizer.decode(reference_greedy(sources, tokenizer(PROMPT)["input_ids"], 8), skip_special_tokens=True)

    def ask(_: int = 0) -> str:
        reply = client.invoke("smollm2", {"prompt": PROMPT, "max_new_tokens": 8})
        assert reply.status == 200, reply.body
        return reply.json()["text"]

    # One request at a time: the model is warm and quiet, and ends on one whole replica.
    deadline = time.monotonic() + 180
    while not (layout(r) == WHOLE and all(replicas(client)[n] == 0 for n in NARROW)):
        assert time.monotonic() < deadline, f"no consolidation: {layout(r)}, {replicas(client)}"
        assert ask() == expected
    assert replicas(client)["smollm2-whole"] == 1
    time.sleep(3)  # autoscaler ticks: the consolidated model stays so under the same load
    assert ask() == expected and layout(r) == WHOLE

    # A burst needs more than one whole replica: the stage functions come back, the whole replica goes.
    with ThreadPoolExecutor(12) as pool:
        texts = list(pool.map(ask, range(24)))
    assert set(texts) == {expected}
    wait_until(lambda: layout(r) == PIPELINED and replicas(client)["smollm2-whole"] == 0, 120, "the split")
    assert all(replicas(client)[n] >= 1 for n in NARROW)
    assert ask() == expected
    changes = [f[b"layout"].decode() for _, f in r.xrange(keys.layout_decisions("smollm2"))]
    cycle = ["consolidating", "whole", "splitting", "pipelined"]
    assert any(changes[i:i + 4] == cycle for i in range(len(changes))), changes
