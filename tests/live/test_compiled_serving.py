"""QUART_COMPILE the way a user turns it on: a user's own decoder (LLaMA-shaped, random weights
written by transformers' save_pretrained) in two stages on the embedded runtime with decode steps
compiled, their steps on the host's idle cores (QUART_IDLE_CORES's default). The replicas serve eagerly
while they compile, for each thread count their steps run on (their own, the host's cores), then
their records say the decode steps ran compiled, and the tokens, alone and batched, are the
unsplit model's. The KeysManager caches a stage before its compile ends; a replica forked once its
compiled successor took the zygote's place runs its decode steps compiled from the first."""
from __future__ import annotations

import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
from transformers import AutoTokenizer

from contracts.http_client import GatewayClient
from contracts.stage import StageRef
from engine.idle_cores import CALM_S, usable_cores
from keysmanager.client import KeysClient, KeysManagerError
from models.architectures import architecture
from models.decode_batches import FEW_ROWS
from models.random_checkpoint import write_random_checkpoint
from runtime.ports import free_port
from state.records import StageSample
from state.store import RedisStore
from tests.live.runtime_helpers import STACK_HEAD, greedy_reference, wait_until
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


def _decode_samples(store: RedisStore, rid: str, since: float, replica: str = "") -> list[list[StageSample]]:
    """Per stage, the records of the request's decode steps (those of `replica` if given)."""
    return [[s for s in store.samples(MODEL, stage, since)
             if s.kind == "decode" and s.request_id.startswith(rid + ".") and s.replica_id.endswith(replica)]
            for stage in range(2)]


def _decode_records(store: RedisStore, rid: str, since: float, replica: str = "") -> list[list[bool]]:
    """Per stage, whether each of the request's decode steps (those of `replica` if given) ran compiled."""
    return [[s.compiled for s in stage] for stage in _decode_samples(store, rid, since, replica)]


def _expected(folder) -> dict[str, list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    reference = architecture("llama").reference(folder)
    return {t: greedy_reference(reference, tokenizer(t)["input_ids"], NEW)[0] for t in TEXTS}


def _until_compiled(client: GatewayClient, store: RedisStore, expected: dict[str, list[int]]) -> None:
    """Sends a request at a time, each answered as the unsplit model (eager steps while the
    replicas compile), until one's decode steps all ran compiled."""
    deadline, ran = time.monotonic() + 900, []
    while True:
        since = time.time() - 1.0
        reply = _generate(client, TEXTS[0])
        assert reply["token_ids"] == expected[TEXTS[0]]
        ran = _decode_records(store, reply["id"], since)
        if all(r and all(r) for r in ran):
            return
        assert time.monotonic() < deadline, f"decode steps still eager after 900 s: {ran}"
        time.sleep(2.0)


def test_decode_steps_compile_in_the_background_and_answer_as_the_unsplit_model(compiled):
    settings, folder = compiled
    client, store = GatewayClient(settings.gateway.url, timeout=120), RedisStore.from_url(settings.redis_url)
    expected = _expected(folder)
    _until_compiled(client, store, expected)
    since = time.time() - 1.0
    with ThreadPoolExecutor(len(TEXTS)) as pool:
        replies = list(pool.map(lambda t: _generate(client, t), TEXTS))
    for text, reply in zip(TEXTS, replies):
        assert reply["token_ids"] == expected[text], text
        # A step that holds another request's prefill runs eager (the requests' prefills need not
        # share a step); every one after the last prefill is decodes only, and compiled.
        assert all(r and r[-1] for r in _decode_records(store, reply["id"], since)), text
    # Each cold replica compiled for every count its steps run on (steps on a count not compiled
    # yet run on one that is), from the caches a worker process filled (models/compile_worker.py).
    counts = sorted({1, usable_cores()})
    compiled_for = f"decode steps compiled for {'/'.join(map(str, counts))} threads"

    def logs() -> str:
        return "".join(p.read_text(errors="replace") for p in (Path(settings.home) / "logs").glob("*.log"))
    wait_until(lambda: logs().count(compiled_for) >= 2, 900, f"each replica compiled for each of {counts} threads")
    assert logs().count("the compile worker filled inductor's caches") >= 2, "a replica compiled without its worker"
    # Alone, after the burst's overlapping steps have calmed, a request's steps take every core, its
    # decodes compiled; and so do the next one's, sent as soon as the first is answered: the
    # first's frees, which reach every holder at once, are not steps that overlap.
    time.sleep(2 * CALM_S)
    since = time.time() - 1.0
    for rid in [_generate(client, t)["id"] for t in TEXTS[:2]]:
        steps = [s for stage in _decode_samples(store, rid, since) for s in stage]
        assert steps and all(s.compiled and s.threads == counts[-1] for s in steps), \
            [(s.compiled, s.threads) for s in steps]
        prefills = [s.threads for stage in range(2) for s in store.samples(MODEL, stage, since)
                    if s.kind == "prefill" and s.request_id.startswith(rid + ".")]
        assert prefills == [counts[-1]] * 2, prefills


def test_compiled_steps_batch_at_most_a_few_sequences_and_the_rest_run_beside_them(compiled):
    """More requests at once than a compiled step multiplies as a few rows (FEW_ROWS): each
    compiled step holds at most that many (engine/batch_policy.batch_limit), the others run in
    steps of their own, and every answer is the unsplit model's."""
    settings, folder = compiled
    client, store = GatewayClient(settings.gateway.url, timeout=120), RedisStore.from_url(settings.redis_url)
    expected = _expected(folder)
    _until_compiled(client, store, expected)
    texts = [TEXTS[i % len(TEXTS)] for i in range(FEW_ROWS + 3)]
    since = time.time() - 1.0
    with ThreadPoolExecutor(len(texts)) as pool:
        replies = list(pool.map(lambda t: _generate(client, t), texts))
    for text, reply in zip(texts, replies):
        assert reply["token_ids"] == expected[text], text
    batches = [s.batch for reply in replies for stage in _decode_samples(store, reply["id"], since)
               for s in stage if s.compiled]
    assert batches and max(batches) <= FEW_ROWS, sorted(set(batches))
    assert max(batches) > 1, "the requests never shared a step"


def test_a_stage_is_cached_before_it_compiles_and_later_forks_run_compiled_steps_from_their_first(compiled):
    """The cache answers once the zygote has loaded, and a fork then serves at once; a successor
    compiles meanwhile and takes the zygote's place, whose forks live on; a fork from it runs its
    decode steps compiled from the first."""
    settings, folder = compiled
    client, store = GatewayClient(settings.gateway.url, timeout=120), RedisStore.from_url(settings.redis_url)
    keys = KeysClient.for_settings(settings, timeout=900)
    stage = StageRef.parse(MODEL, "1")
    with contextlib.suppress(KeysManagerError):
        keys.evict(stage)  # cached already as a key stage: this test caches it afresh
    first = keys.cache(stage)
    assert first["compile"] == "compiling", first  # a compile takes seconds at the least
    early = keys.fork(stage, f"{MODEL}-s1")["pid"]
    pids = [early]
    try:
        wait_until(lambda: any(r.replica_id.endswith(f".{early}") for r in store.live_replicas(MODEL, 1)), 120,
                   "the replica forked before the compile registered")
        settled = keys.settled(stage, 900)
        assert settled["compile"] == "done" and settled["pid"] != first["pid"], settled
        wait_until(lambda: not psutil.pid_exists(first["pid"]), 60, "the first zygote ended")
        assert psutil.pid_exists(early), "a fork ended with the zygote it was forked from"
        keys.stop(early)
        pid = keys.fork(stage, f"{MODEL}-s1")["pid"]
        pids.append(pid)
        replica = f".{pid}"
        wait_until(lambda: any(r.replica_id.endswith(replica) for r in store.live_replicas(MODEL, 1)), 120,
                   "the forked replica registered")
        # One request at a time (no prefill shares a step with decodes), until the fork takes one.
        expected, deadline, ran = _expected(folder)[TEXTS[1]], time.monotonic() + 300, [[], []]
        while not ran[1]:
            assert time.monotonic() < deadline, "the forked replica took no request in 300 s"
            since = time.time() - 1.0
            reply = _generate(client, TEXTS[1])
            assert reply["token_ids"] == expected
            ran = _decode_records(store, reply["id"], since, replica)
        assert all(ran[1]), ran[1]
    finally:
        for pid in pids:
            with contextlib.suppress(KeysManagerError):
                keys.stop(pid)
