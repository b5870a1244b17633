"""λScale's peer start on the embedded runtime: three virtual servers, each with its own models
folder, read SmolLM2's shards from the runtime's model store (QUART_VIRTUAL_DISKS) over a link
slower than theirs. Stage 1 is cached on the first server; scaled to three replicas as a key
stage, its two new replicas go to the other servers and receive the stage from the first by
multicast instead of both reading the store: the placements say so with their prediction, the
shards arrive byte for byte, the targets cache the stage from what they received (holders for the
next burst; the store sent it to none of them), and the replicas answer with the unsplit model's tokens."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from contracts.http_client import GatewayClient
from contracts.paths import REPO_ROOT
from contracts.stack import one_model_stack
from contracts.stage import StageRef
from keysmanager.client import KeysClient
from models.architectures import architecture
from models.manifest import Manifest
from models.sources import bundled_dir
from runtime import __main__ as control
from runtime.ports import free_port
from state.store import RedisStore
from tests.live.runtime_helpers import greedy_reference, wait_until

MODEL, STAGE = "smollm2", "smollm2:1"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def servers(home_settings, partitioned, tmp_path_factory):
    partitioned(MODEL, 4)
    home = tmp_path_factory.mktemp("peers")
    settings = home_settings.replace(
        home=str(home), models=str(home_settings.models_dir),
        stack_file=str(one_model_stack(REPO_ROOT / "stack.yml", home / "stack.yml", MODEL)),
        gateway_port=free_port(), redis_port=free_port(), keysmanager_port=free_port(), policy="none",
        server="vs", virtual_servers=3, server_slots=6, virtual_disks=True,
        # Stage 1 of SmolLM2 is 156 MB: two targets reading it from the store take 2·M/B_store
        # = 12.5 s, a multicast from the server that caches it (8 + 1 - 1 rounds of an eighth) 3.1 s.
        server_bandwidth=5e7, store_bandwidth=2.5e7, cold_deadline_s=600.0,
        cache_stages=STAGE, request_timeout_s=120.0, admit_wait_s=0.0, drain_timeout_s=5.0)
    try:
        assert control.up(settings, timeout=600) == 0
        yield settings
    finally:
        control.down(settings)


def sent_by_store(settings, shard: str) -> int:
    """How often the runtime's model store has sent `shard` (its log says each time)."""
    log = (Path(settings.home) / "logs" / "store.log").read_text()
    return sum(f"sent {MODEL}/{shard} " in line for line in log.splitlines())


def keys(settings, name: str) -> KeysClient:
    return KeysClient.for_settings(settings.virtual_server(name), timeout=60)


def test_a_key_stage_scaled_out_is_multicast_from_the_server_that_caches_it(servers):
    settings = servers
    client, store = GatewayClient.for_settings(settings), RedisStore.from_url(settings.redis_url)
    first, others = "vs-0", ["vs-1", "vs-2"]
    wait_until(lambda: any(z["stages"] == "1" for z in keys(settings, first).zygotes()), 300, "stage 1 cached on vs-0")
    manifest = Manifest.load(settings.model_dir(MODEL))
    shard = manifest.stages[1]
    # The first server fetched its shard from the store into its own folder, and serves it from there.
    own = settings.virtual_server(first).model_dir(MODEL) / shard.shard
    assert hashlib.sha256(own.read_bytes()).hexdigest() == shard.sha256
    wait_until(lambda: all(f["availableReplicas"] >= 1 for f in client.functions()), 300, "every function ready")

    store.publish_key_stages(MODEL, (StageRef.parse(MODEL, "1"),))  # what the autoscaler names under a burst
    before, sent_before = len(store.placements()), sent_by_store(settings, shard.shard)
    assert client.scale(f"{MODEL}-s1", 3).status == 202
    wait_until(lambda: len([p for p in store.placements()[before:] if p.op == "add"]) == 2, 60, "two placements")
    added = [p for p in store.placements()[before:] if p.op == "add"]
    assert sorted(p.server for p in added) == others, added
    assert {p.path for p in added} == {"peer"}, added
    assert all("peer from vs-0" in p.reason and p.predicted_s > 0 for p in added), added
    # One multicast: both targets receive the shard from vs-0 and each other, whole and checked.
    for name in others:
        wait_until(lambda name=name: any(r["shard"] == shard.shard and r["state"] == "done"
                                         for r in keys(settings, name).receptions()), 120, f"{name}'s reception")
        received = settings.virtual_server(name).prefetch_dir(name) / MODEL / shard.shard
        assert hashlib.sha256(received.read_bytes()).hexdigest() == shard.sha256
    wait_until(lambda: next(f for f in client.functions() if f["name"] == f"{MODEL}-s1")["availableReplicas"] == 3,
               180, "three ready replicas of stage 1")
    ready = [p for p in store.placements()[before:] if p.op == "ready" and p.path == "peer"]
    assert sorted(p.server for p in ready) == others and all(p.took_s > 0 and p.predicted_s > 0 for p in ready), ready

    # Each target caches the key stage from what it received (a holder for the next burst), and
    # the store sent the shard to none of them.
    for name in others:
        wait_until(lambda name=name: any(z["stages"] == "1" for z in keys(settings, name).zygotes()), 180,
                   f"stage 1 cached on {name}")
    assert sent_by_store(settings, shard.shard) == sent_before, "the store sent the stage again"

    reference = bundled_dir(MODEL, settings.models_dir / "_sources")
    tokenizer = AutoTokenizer.from_pretrained(reference)
    expected = tokenizer.decode(greedy_reference(architecture("llama").reference(reference),
                                                 tokenizer(PROMPT)["input_ids"], 8)[0], skip_special_tokens=True)
    for _ in range(4):  # round robin over the stage's replicas
        reply = client.invoke(MODEL, {"prompt": PROMPT, "max_new_tokens": 8, "ignore_eos": True})
        assert reply.status == 200, reply.body
        assert reply.json()["text"] == expected
