"""What the runtime's live tests share: the unsplit reference, waiting, and scaling through the gateway."""
from __future__ import annotations

import time

import redis
import torch

from contracts.http_client import GatewayClient
from state.store import RedisStore
from tests.openapi_check import checked


def reference_greedy(sources, ids: list[int], max_new: int) -> list[int]:
    """Unsplit transformers `generate(use_cache=True)`, greedy, up to and with the end of text."""
    model = sources["smollm2"].model
    eos = model.config.eos_token_id
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, use_cache=True,
                             eos_token_id=eos, pad_token_id=eos)
    return out[0, len(ids):].tolist()


def greedy_reference(model, prompt: list[int], new: int) -> tuple[list[int], torch.Tensor]:
    """The unsplit model's greedy tokens, each from a full forward pass (no cache to share bugs with)."""
    ids, first = list(prompt), None
    with torch.inference_mode():
        for _ in range(new):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
            first = logits if first is None else first
            ids.append(int(logits.argmax()))
    return ids[len(prompt):], first


# A stack file's head: a test appends a model's functions (tools.stack.add).
STACK_HEAD = """version: 1.0
provider:
  name: openfaas
  gateway: http://127.0.0.1:8080
functions:
"""


def wait_until(predicate, timeout: float, what: str):
    """What `predicate` returns once that is truthy, asked every 0.25 s; AssertionError naming
    `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def available(client: GatewayClient, name: str) -> int:
    return client.request("GET", f"/system/function/{name}").json()["availableReplicas"]


def scale_and_wait(client: GatewayClient, r: redis.Redis, name: str, replicas: int, stage: int | None) -> None:
    assert checked(client, "POST", f"/system/scale-function/{name}", "/system/scale-function/{functionName}",
                   {"serviceName": name, "namespace": "openfaas-fn", "replicas": replicas}).status == 202
    wait_until(lambda: available(client, name) == replicas, 120, f"{name} at {replicas} replicas")
    if stage is not None:
        model = name.rsplit("-s", 1)[0]
        wait_until(lambda: len(RedisStore(r).live_replicas(model, stage)) == replicas, 30, f"{name} registry at {replicas}")
