"""Scale to zero and back on a runtime of its own (real SmolLM2, no cached stages, the QUART
autoscaler running): its stage functions, labelled com.openfaas.scale.zero, go to zero replicas
once idle, and the first request after starts them all and is answered, with the requests that
arrive meanwhile queued behind it, not refused."""
from __future__ import annotations

import asyncio
import time

import pytest

from contracts.http_client import GatewayClient
from contracts.paths import REPO_ROOT
from contracts.stack import scale_to_zero_stack
from runtime import __main__ as control
from runtime.ports import free_port
from state import keys
from tests.live.runtime_helpers import reference_greedy, wait_until

IDLE = "4s"


@pytest.fixture(scope="module")
def sleepy(home_settings, partitioned, tmp_path_factory):
    partitioned("smollm2", 4)
    home = tmp_path_factory.mktemp("zero")
    stack = scale_to_zero_stack(REPO_ROOT / "stack.yml", home / "stack.yml", "smollm2", IDLE)
    settings = home_settings.replace(
        home=str(home), models=str(home_settings.models_dir), stack_file=str(stack),
        gateway_port=free_port(), redis_port=free_port(), keysmanager_port=free_port(), cache_stages="none",
        request_timeout_s=120.0, admit_wait_s=1.0, r_min=1)
    try:
        assert control.up(settings, timeout=600) == 0
        yield settings
    finally:
        control.down(settings)


def stage_replicas(client: GatewayClient) -> dict[str, tuple[int, int]]:
    return {f["name"]: (f["replicas"], f["availableReplicas"]) for f in client.functions()
            if f["name"].startswith("smollm2-s")}


def test_idle_stages_go_to_zero_and_the_first_request_wakes_them_all(sleepy, sources, tokenizer):
    client = GatewayClient.for_settings(sleepy)
    r = __import__("redis").Redis.from_url(sleepy.redis_url)
    prompt = "The capital of France is"
    ids = tokenizer(prompt)["input_ids"]
    expected = tokenizer.decode(reference_greedy(sources, ids, 6), skip_special_tokens=True)
    reply = client.invoke("smollm2", {"prompt": prompt, "max_new_tokens": 6})
    assert reply.status == 200 and reply.json()["text"] == expected
    # Idle for the zero-duration: every stage function at zero, no replica left; the entry stays.
    wait_until(lambda: all(v == (0, 0) for v in stage_replicas(client).values()), 120, "the stages at zero")
    assert r.exists(keys.asleep("smollm2"))
    assert {f["name"]: f["availableReplicas"] for f in client.functions()}["smollm2"] == 1
    time.sleep(3)  # several autoscaler ticks: it leaves the sleeping model alone
    assert all(v == (0, 0) for v in stage_replicas(client).values())

    # Five requests at once: the first wakes every stage, the others queue behind it; all answered.
    async def burst() -> list:
        started = time.monotonic()
        replies = await asyncio.gather(*(asyncio.to_thread(
            client.invoke, "smollm2", {"prompt": prompt, "max_new_tokens": 6}) for _ in range(5)))
        return replies, time.monotonic() - started

    replies, took = asyncio.run(burst())
    assert [x.status for x in replies] == [200] * 5, [x.body[:200] for x in replies]
    assert {x.json()["text"] for x in replies} == {expected}
    assert all(desired >= 1 for desired, _ in stage_replicas(client).values()), stage_replicas(client)
    assert not r.exists(keys.asleep("smollm2"))
    print(f"five requests from zero answered in {took:.1f} s")


def test_bad_scale_to_zero_labels_are_refused(sleepy):
    client = GatewayClient.for_settings(sleepy)
    deployment = {"service": "smollm2-s9", "image": "quart/stage:0.1.0",
                  "envVars": {"QUART_MODEL": "smollm2", "QUART_STAGES": "9"}}
    for labels, text in (({"com.openfaas.scale.zero": "sometimes"}, "true or false"),
                         ({"com.openfaas.scale.zero": "true", "com.openfaas.scale.zero-duration": "soon"}, "duration")):
        reply = client.request("POST", "/system/functions", {**deployment, "labels": labels})
        assert reply.status == 400 and text in reply.json()["error"]
