"""Overload on a runtime of its own (emulated 8-stage WideResNet, one replica per stage, about 8
requests/s sustainable, no autoscaler): about 4× that rate, open loop, gets fast 429s with a
Retry-After, and the requests accepted answer without timing out."""
from __future__ import annotations

import asyncio
import statistics

import pytest

from contracts.http_client import GatewayClient
from loadgen.client import replay
from loadgen.requests import Request
from models.profiles import write_stack
from runtime import __main__ as control
from runtime.ports import free_port

MODEL = "wideresnet"
RATE, SECONDS = 32.0, 12.0


@pytest.fixture(scope="module")
def overloaded(home_settings, tmp_path_factory):
    home = tmp_path_factory.mktemp("overload")
    settings = home_settings.replace(
        home=str(home), models=str(home_settings.models_dir), stack_file=str(write_stack(MODEL, home / "stack.yml")),
        gateway_port=free_port(), redis_port=free_port(), keysmanager_port=free_port(), policy="none",
        cache_stages="none", request_timeout_s=30.0, admit_wait_s=1.0)
    try:
        assert control.up(settings, timeout=600) == 0
        yield settings
    finally:
        control.down(settings)


def test_four_times_the_sustainable_rate_gets_fast_429s(overloaded):
    requests = [Request(i, i / RATE, MODEL, {"tokens": 16}, 16, 0) for i in range(int(RATE * SECONDS))]
    records = asyncio.run(replay(overloaded.gateway.url, requests, timeout_s=60, progress=False))
    by_status: dict[int, list] = {}
    for rec in records:
        by_status.setdefault(rec.status, []).append(rec)
    # Nothing timed out, failed or went unanswered: accepted, or refused at the door.
    assert set(by_status) == {200, 429}, {s: [r.error for r in rs][:3] for s, rs in by_status.items()}
    assert len(by_status[429]) > len(requests) / 4
    assert all("overloaded" in r.error for r in by_status[429])
    refused = statistics.median(r.latency_s for r in by_status[429])
    accepted = [r.latency_s for r in by_status[200]]
    assert refused < statistics.median(accepted)
    # Queues were bounded by admission, so no accepted request came near the request timeout.
    assert max(accepted) < overloaded.data.request_timeout_s / 3, sorted(accepted)[-5:]


def test_a_refusal_says_when_to_come_back_and_the_model_serves_again(overloaded):
    client = GatewayClient(overloaded.gateway.url, timeout=60)

    async def burst() -> list:
        requests = [Request(i, i / RATE, MODEL, {"tokens": 16}, 16, 0) for i in range(int(RATE * 4))]
        return await replay(overloaded.gateway.url, requests, timeout_s=60, progress=False)

    async def refusal_during_burst():
        task = asyncio.ensure_future(burst())
        reply = None
        for _ in range(60):
            await asyncio.sleep(0.1)
            reply = await asyncio.to_thread(client.invoke, MODEL, {"tokens": 16})
            if reply.status == 429:
                break
        await task
        return reply
    reply = asyncio.run(refusal_during_burst())
    assert reply.status == 429 and int(reply.headers["Retry-After"]) >= 1, reply
    assert "error" in reply.json()
    assert client.invoke(MODEL, {"tokens": 16}).status == 200
