"""The layout controller on a runtime of its own (real SmolLM2, and a Gemma 2 model from a folder;
the QUART autoscaler running, a whole-model function beside the four stage functions): warm and quiet, the model consolidates
into one whole replica and its stage functions go to zero; a burst splits it back into the stage
functions and the whole replica goes. Every request is answered, with the unsplit model's tokens."""
from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis
import yaml
from transformers import AutoTokenizer

from autoscaler.policy.layout import PIPELINED, WHOLE
from contracts.config import Settings
from contracts.http_client import GatewayClient
from contracts.paths import REPO_ROOT
from contracts.stack import TTFT_SLO_LABEL, consolidating_stack, scale_to_zero_stack
from models.architectures import architecture
from models.random_checkpoint import write_random_checkpoint
from models.sources import bundled_dir
from runtime import __main__ as control
from runtime.ports import free_port
from state.store import RedisStore
from tests.live.runtime_helpers import STACK_HEAD, greedy_reference, wait_until
from tools import stack as stack_tool

PROMPT = "The capital of France is"
# SmolLM2 (real weights, LLaMA), and a Gemma-2-shaped model of SmolLM2's size with random weights
# from a folder, as a user's own model is served: consolidation and split move its caches too.
GEMMA = {"hidden_size": 576, "num_hidden_layers": 30, "intermediate_size": 1536, "num_attention_heads": 9,
         "num_key_value_heads": 3, "head_dim": 64, "query_pre_attn_scalar": 64, "sliding_window": 4}


@pytest.fixture(scope="module", params=["smollm2", "my-gemma2"])
def consolidating(request, home_settings, partitioned, tmp_path_factory):
    """(settings, model, the unsplit model's checkpoint folder)."""
    model, cache = request.param, home_settings.models_dir / "_sources"
    home = tmp_path_factory.mktemp("layout")
    if model == "smollm2":
        partitioned("smollm2", 4)
        source, reference = REPO_ROOT / "stack.yml", bundled_dir("smollm2", cache)
    else:
        reference = write_random_checkpoint("gemma2", cache, GEMMA, seed=9)
        source = home / "own.yml"
        source.write_text(STACK_HEAD)
        stack_tool.add(source, model, str(reference), 4, cache)
    # The stage functions also scale to zero when idle (15 m): at zero for the layout, they stay there.
    with layout_runtime(home_settings, home, source, model, "15m") as settings:
        yield settings, model, reference


@contextmanager
def layout_runtime(home_settings, home: Path, source: Path, model: str, idle: str,
                   labels: dict[str, str] | None = None, **changes: object) -> Iterator[Settings]:
    """A runtime serving `model` from `source` with a whole-model function beside its stage
    functions, these labelled to scale to zero after `idle` (and with `labels`), and short layout
    windows; `changes`: more settings."""
    stack = scale_to_zero_stack(consolidating_stack(source, home / "whole.yml", model), home / "stack.yml", model, idle)
    if labels:
        spec = yaml.safe_load(stack.read_text())
        for name, fn in spec["functions"].items():
            if name != f"{model}-whole" and "QUART_STAGES" in fn.get("environment", {}):
                fn["labels"] = {**fn.get("labels", {}), **labels}
        stack.write_text(yaml.safe_dump(spec, sort_keys=False))
    settings = home_settings.replace(
        home=str(home), models=str(home_settings.models_dir), stack_file=str(stack),
        gateway_port=free_port(), redis_port=free_port(), keysmanager_port=free_port(), cache_stages="none",
        request_timeout_s=120.0, admit_wait_s=0.0, r_min=1, max_batch=4, layout_window_s=2.0, layout_windows=3,
        **changes)
    try:
        assert control.up(settings, timeout=600) == 0
        yield settings
    finally:
        control.down(settings)


def model_type(folder: Path) -> str:
    return json.loads((Path(folder) / "config.json").read_text())["model_type"]


def replicas(client: GatewayClient, model: str) -> dict[str, int]:
    return {f["name"]: f["availableReplicas"] for f in client.functions() if f["name"].startswith(model + "-")}


def layout(r: redis.Redis, model: str) -> str:
    return RedisStore(r).layout(model)


def quietly(ask: Callable[[], str], settings: Settings) -> str:
    """ask(), then wait out half a layout window from its start. The layout rule counts arrivals per
    window (HydraServe's sliding window), not requests in flight: a fast host answering one request
    at a time would send more a window than a whole replica's batch and never look quiet."""
    start = time.monotonic()
    text = ask()
    time.sleep(max(0.0, start + settings.autoscaler.layout_window_s / 2 - time.monotonic()))
    return text


def test_a_quiet_model_consolidates_and_a_burst_splits_it(consolidating):
    settings, model, reference = consolidating
    narrow = [f"{model}-s{i}" for i in range(4)]
    client = GatewayClient.for_settings(settings)
    r = redis.Redis.from_url(settings.redis_url)
    tokenizer = AutoTokenizer.from_pretrained(reference)
    ids = tokenizer(PROMPT)["input_ids"]
    expected = tokenizer.decode(greedy_reference(architecture(model_type(reference)).reference(reference), ids, 8)[0],
                                skip_special_tokens=True)

    def ask(_: int = 0) -> str:
        reply = client.invoke(model, {"prompt": PROMPT, "max_new_tokens": 8, "ignore_eos": True})
        assert reply.status == 200, reply.body
        return reply.json()["text"]

    # One request at a time, at most two a window: the model is warm and quiet, and ends on one whole replica.
    deadline = time.monotonic() + 180
    while not (layout(r, model) == WHOLE and all(replicas(client, model)[n] == 0 for n in narrow)):
        assert time.monotonic() < deadline, f"no consolidation: {layout(r, model)}, {replicas(client, model)}"
        assert quietly(ask, settings) == expected
    # Ready may blink on a loaded host (a probe or two missed): one whole replica, once it answers probes.
    wait_until(lambda: replicas(client, model)[f"{model}-whole"] == 1, 60, "the whole replica available")
    time.sleep(3)  # autoscaler ticks: the consolidated model stays so under the same load
    assert ask() == expected and layout(r, model) == WHOLE

    # A burst needs more than one whole replica: the stage functions come back, the whole replica goes.
    with ThreadPoolExecutor(12) as pool:
        texts = list(pool.map(ask, range(24)))
    assert set(texts) == {expected}
    wait_until(lambda: layout(r, model) == PIPELINED and replicas(client, model)[f"{model}-whole"] == 0, 300, "the split")
    assert all(replicas(client, model)[n] >= 1 for n in narrow)
    assert ask() == expected
    changes = [c.layout for c in RedisStore(r).layout_changes(model)]
    cycle = ["consolidating", "whole", "splitting", "pipelined"]
    assert any(changes[i:i + 4] == cycle for i in range(len(changes))), changes


# SmolLM2's 651 MB over 4 virtual servers that fetch at 10 MB/s, as the scheduler sees them:
# whole, a wake is predicted to give its first token in 65 s or more; as its stage functions, each
# fetching a quarter over a server of its own, in about 16 s (unless imports take longer).
SLOW_SERVERS = {"virtual_servers": 4, "server_bandwidth": 1e7, "cold_deadline_s": 600.0}


@pytest.mark.parametrize("objective, wakes", [("40s", PIPELINED), ("150s", WHOLE)])
def test_a_model_served_whole_sleeps_when_idle_and_wakes_in_the_layout_algorithm1_chooses(
        home_settings, partitioned, tmp_path, objective, wakes):
    """SmolLM2 consolidates while requests come one at a time; idle for its zero-duration, its
    whole replica goes and it sleeps; the next request wakes it as its stage functions where only
    they can give the first token within the TTFT objective, else whole (the fewer replicas), and
    is answered with the unsplit model's tokens."""
    partitioned("smollm2", 4)
    model = "smollm2"
    reference = bundled_dir("smollm2", home_settings.models_dir / "_sources")
    tokenizer = AutoTokenizer.from_pretrained(reference)
    expected = tokenizer.decode(greedy_reference(architecture("llama").reference(reference),
                                                 tokenizer(PROMPT)["input_ids"], 8)[0], skip_special_tokens=True)
    with layout_runtime(home_settings, tmp_path, REPO_ROOT / "stack.yml", model, "8s",
                        {TTFT_SLO_LABEL: objective}, **SLOW_SERVERS) as settings:
        client, store = GatewayClient.for_settings(settings), RedisStore(redis.Redis.from_url(settings.redis_url))

        def ask() -> str:
            reply = client.invoke(model, {"prompt": PROMPT, "max_new_tokens": 8, "ignore_eos": True})
            assert reply.status == 200, reply.body
            return reply.json()["text"]

        # Requests one at a time until the model consolidates, none while its stages hand over:
        # a prefill entering just as they go can be stranded (docs/limitations.md, Consolidation).
        deadline = time.monotonic() + 180
        while store.layout(model) == PIPELINED:
            assert time.monotonic() < deadline, f"no consolidation: {store.layout(model)}, {replicas(client, model)}"
            assert quietly(ask, settings) == expected
        wait_until(lambda: store.layout(model) == WHOLE, 120, "the whole model serving")
        wait_until(lambda: store.asleep([model]) == {model}, 120, "the whole model asleep")
        assert store.layout(model) == PIPELINED
        wait_until(lambda: all(n == 0 for n in replicas(client, model).values()), 60, "every replica gone")
        before = len(store.placements())
        assert ask() == expected  # woken on its way in
        changes = store.layout_changes(model)
        slept = [(c.layout, c.reason) for c in changes].index((PIPELINED, "asleep: its layout is chosen as it wakes"))
        assert changes[slept - 1].layout == WHOLE
        woke = changes[slept + 1]
        assert woke.layout == wakes and woke.reason.startswith("woken"), woke
        assert f"the {objective.removesuffix('s')} s TTFT objective" in woke.reason, woke
        woken = {p.stage for p in store.placements()[before:] if p.op == "add"}
        stages = {f"{model}:{i}" for i in range(4)}
        if wakes == WHOLE:
            assert f"{model}:0-4" in woken and not woken & stages, woken
        else:  # each stage function placed again (the layout rule may consolidate the model again at once)
            assert stages <= woken, woken
