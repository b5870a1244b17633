"""The LLM data plane end to end: KV caches in the stage replicas, continuous batching, streaming,
the OpenAI-compatible API, KV budgets, scaling and kill -9 mid-generation. Real weights, real
replica processes, a real redis-server, real HTTP."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import aiohttp
import openai
import psutil
import pytest
import redis
import torch

from contracts.http_client import GatewayClient
from engine.idle_cores import CALM_S, usable_cores
from loadgen.sharegpt import first_prompts
from state.store import RedisStore
from tests.live.runtime_helpers import available, reference_greedy, scale_and_wait, wait_until
from tests.openapi_check import checked

NEW_TOKENS = 64
NEAR_TIE = 1e-4


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    """20 ShareGPT opening turns, tokenised."""
    return [tokenizer(p)["input_ids"] for p in first_prompts(20, seed=12, max_chars=240)]


@pytest.fixture(scope="module")
def references(sources, prompts) -> list[list[int]]:
    """Unsplit transformers `generate(use_cache=True)`, greedy, for every prompt."""
    return [reference_greedy(sources, ids, NEW_TOKENS) for ids in prompts]


def generate(client: GatewayClient, text: str, max_new: int = NEW_TOKENS, **extra):
    return client.invoke("smollm2", {"prompt": text, "max_new_tokens": max_new, **extra})


def same_or_near_tie(sources, prompt: list[int], got: list[int], expected: list[int]) -> None:
    """Equal continuations, or the first difference follows a near-tie of the unsplit model (its
    top two logits within NEAR_TIE), where another summation order may pick the other token."""
    if got == expected:
        return
    at = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
    with torch.inference_mode():
        logits = sources["smollm2"].model(input_ids=torch.tensor([prompt + expected[:at]])).logits[0, -1]
    top = logits.topk(2).values
    gap = float(top[0] - top[1])
    assert gap <= NEAR_TIE, f"continuations differ at token {at} where the unsplit model's margin is {gap:.2e}"


def run_concurrently(fn, args: list, workers: int) -> list:
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda a: fn(*a), args))


# -- answers -----------------------------------------------------------------------------------

def test_greedy_tokens_equal_unsplit_generate_alone_and_batched(client, sources, tokenizer, prompts, references):
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in prompts]
    # The prompts go as text; the entry tokenises them the same way (checked per request below).
    for text, ids, expected in zip(texts, prompts, references):
        assert tokenizer(text)["input_ids"] == ids
        reply = generate(client, text)
        assert reply.status == 200, reply.body
        assert reply.json()["token_ids"] == expected, text
    replies = run_concurrently(lambda t: generate(client, t), [(t,) for t in texts[:8]], 8)
    batched = []
    for reply, ids, expected in zip(replies, prompts, references):
        assert reply.status == 200, reply.body
        same_or_near_tie(sources, ids, reply.json()["token_ids"], expected)
        batched.append(reply.json())
    assert all(a["ttft_ms"] > 0 and (a["tpot_ms"] > 0) == (len(a["token_ids"]) > 1) for a in batched)
    metrics = client.request("GET", "/function/smollm2-s1/metrics", auth=False).body.decode()
    sizes = _histogram_sum_count(metrics, "quart_stage_batch_size")
    assert sizes[0] > sizes[1], "every batch held one item: nothing was batched"


def test_alone_a_prefill_takes_every_core_and_eager_decode_steps_their_own(client, r):
    """QUART_IDLE_CORES's default (`all`): with nothing else computing, each stage's prefill runs
    on the host's cores, one after another; decode steps that run eager (these tests' replicas do
    not compile) stay on the replica's one thread (tests/live/test_compiled_serving.py has the
    compiled ones take the cores)."""
    time.sleep(2 * CALM_S)  # the earlier tests' overlapping steps calmed
    since = time.time() - 1.0
    reply = generate(client, "Name three rivers of Europe.", 4)
    assert reply.status == 200, reply.body
    rid = reply.json()["id"]
    mine = [s for stage in range(4) for s in RedisStore(r).samples("smollm2", stage, since)
            if s.request_id.startswith(rid + ".")]
    threads = {kind: [s.threads for s in mine if s.kind == kind] for kind in ("prefill", "decode")}
    assert threads == {"prefill": [usable_cores()] * 4, "decode": [1] * 12}, threads


def _histogram_sum_count(text: str, name: str) -> tuple[float, float]:
    total = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "_sum"))
    count = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "_count"))
    return total, count


def test_decode_steps_go_to_the_cache_holder_and_prefills_spread(client, r):
    scale_and_wait(client, r, "smollm2-s1", 2, stage=1)
    try:
        replies = run_concurrently(lambda i: generate(client, f"Item {i} of the list is", 6), [(i,) for i in range(8)], 8)
    finally:
        scale_and_wait(client, r, "smollm2-s1", 1, stage=1)
    ids = {reply.json()["id"] for reply in replies}
    assert all(reply.status == 200 for reply in replies)
    by_seq: dict[str, dict[str, set]] = {}
    for x in RedisStore(r).samples("smollm2", 1):
        rid, epoch, _ = x.request_id.split(".")
        if rid in ids:
            by_seq.setdefault(f"{rid}.{epoch}", {}).setdefault(x.kind, set()).add(x.replica_id)
    assert len(by_seq) == 8
    for seq, kinds in by_seq.items():
        assert len(kinds["prefill"]) == 1 and kinds["decode"] == kinds["prefill"], (seq, kinds)
    assert len({next(iter(k["prefill"])) for k in by_seq.values()}) == 2, "every prefill went to one replica"


def test_scaling_a_stage_1_3_1_while_16_generate(client, r, sources, tokenizer, prompts, references):
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in prompts[:16]]
    results: list = []
    sender = threading.Thread(target=lambda: results.extend(
        run_concurrently(lambda t: generate(client, t, 48, ignore_eos=True), [(t,) for t in texts], 16)))
    sender.start()
    scale_and_wait(client, r, "smollm2-s2", 3, stage=2)
    time.sleep(2)
    scale_and_wait(client, r, "smollm2-s2", 1, stage=2)
    sender.join(timeout=300)
    assert len(results) == 16
    assert len({x.json()["id"] for x in results}) == 16
    for reply, ids, expected in zip(results, prompts, references):
        assert reply.status == 200, reply.body
        same_or_near_tie(sources, ids, reply.json()["token_ids"][:len(expected[:48])], expected[:48])


def test_scale_down_migrates_the_caches_a_replica_holds(client, r, sources, tokenizer, prompts, references):
    """A stage replica being removed while it holds requests' caches hands each cache to the
    remaining replica with the request's next step: no request prefills again, all answer alone's
    tokens. Six clients, starting half a second apart, send their prompts again and again: a
    replica takes every prefill that arrives together in one batch (StageTransport.wait_for_work),
    so six requests sent at once could all land on one replica and leave the other none to hand over."""
    scale_and_wait(client, r, "smollm2-s2", 2, stage=2)
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in prompts[2:8]]
    since = time.time()
    waves = _Waves(client, texts, stagger_s=0.5)
    try:
        wait_until(lambda: all(x.sequences > 0 and x.last_seen > since
                               for x in RedisStore(r).live_replicas("smollm2", 2)), 120, "both stage-2 replicas holding caches")
        scale_and_wait(client, r, "smollm2-s2", 1, stage=2)
    finally:
        replies = waves.stop()
    assert [x.status for _, x in replies] == [200] * len(replies), [x.body[:200] for _, x in replies if x.status != 200]
    assert sum(x.json()["recomputes"] for _, x in replies) == 0
    for index, reply in replies:
        expected = references[2 + index]
        same_or_near_tie(sources, prompts[2 + index], reply.json()["token_ids"][:len(expected)], expected)
    assert _migrations_in(client, "smollm2-s2") >= 1, "the remaining replica adopted no cache"


WHOLE = {"service": "smollm2-whole", "image": "quart/stage:0.1.0",
         "envVars": {"QUART_MODEL": "smollm2", "QUART_STAGES": "0-4", "QUART_THREADS": "2"},
         "labels": {"com.quart.whole": "true"}}
NARROW = [f"smollm2-s{i}" for i in range(4)]


def _migrations_in(client: GatewayClient, function: str) -> float:
    metrics = client.request("GET", f"/function/{function}/metrics", auth=False).body.decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("quart_stage_migrations_total") and 'direction="in"' in line)


def _holding(r: redis.Redis, ends: int, at_least: int, since: float) -> bool:
    """Whether replicas at stage 0 whose ranges end at `ends` hold at least `at_least` sequences
    (by counts their heartbeats published after `since`)."""
    found = [x for x in RedisStore(r).live_replicas("smollm2", 0) if x.stage_end == ends]
    return bool(found) and all(x.last_seen > since for x in found) and \
        sum(x.sequences for x in found) >= at_least


class _Waves:
    """One client a text, each sending its prompt again as soon as it is answered, until `stop`: however
    fast the host generates, requests are mid-generation whenever the layout changes (one round
    of requests ended before the whole replica was serving on a fast host)."""

    def __init__(self, client: GatewayClient, texts: list[str], stagger_s: float = 0.0) -> None:
        self.replies: list[tuple[int, object]] = []
        self._stop = threading.Event()
        self._stagger_s = stagger_s
        self._threads = [threading.Thread(target=self._loop, args=(client, i, t)) for i, t in enumerate(texts)]
        for thread in self._threads:
            thread.start()

    def _loop(self, client: GatewayClient, index: int, text: str) -> None:
        self._stop.wait(index * self._stagger_s)  # client `index` starts that many staggers after the first
        while not self._stop.is_set():
            self.replies.append((index, generate(client, text, ignore_eos=True)))

    def stop(self) -> list[tuple[int, object]]:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=300)
        return self.replies


def test_consolidation_and_split_back_while_16_generate(client, r, sources, tokenizer, prompts, references):
    """HydraServe §6 at stage level: 16 clients generating on the 4-stage pipeline; a replica of
    the whole model starts, the narrow replicas are removed, and each request's cache is gathered
    into it on its next step. Then, generating on the whole replica, the stage functions come back
    and the whole replica is removed: each cache is split over them. No request prefills again, and
    every answer has the tokens the unsplit model gives."""
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in prompts[:16]]
    answers: dict[str, list] = {}
    assert client.request("POST", "/system/functions", WHOLE).status == 202
    try:
        scale_and_wait(client, r, "smollm2-whole", 0, stage=None)
        since = time.time()
        waves = _Waves(client, texts)
        wait_until(lambda: _holding(r, 1, 8, since), 120, "requests generating on the pipeline")
        scale_and_wait(client, r, "smollm2-whole", 1, stage=None)
        wait_until(lambda: _holding(r, 4, 0, 0), 60, "the whole replica serving")
        for name in NARROW:  # all at once, as the layout controller does
            checked(client, "POST", f"/system/scale-function/{name}", "/system/scale-function/{functionName}",
                    {"serviceName": name, "namespace": "openfaas-fn", "replicas": 0})
        wait_until(lambda: all(available(client, name) == 0 for name in NARROW), 60, "the narrow replicas gone")
        answers["consolidated"] = waves.stop()
        gathered = _migrations_in(client, "smollm2-whole")

        since = time.time()
        waves = _Waves(client, texts)
        wait_until(lambda: _holding(r, 4, 8, since), 120, "requests generating on the whole replica")
        for name in NARROW:
            checked(client, "POST", f"/system/scale-function/{name}", "/system/scale-function/{functionName}",
                    {"serviceName": name, "namespace": "openfaas-fn", "replicas": 1})
        for stage, name in enumerate(NARROW):
            scale_and_wait(client, r, name, 1, stage=None)
            wait_until(lambda s=stage: any(x.stage_end == s + 1 for x in RedisStore(r).live_replicas("smollm2", s)),
                       30, f"{name} serving")
        scale_and_wait(client, r, "smollm2-whole", 0, stage=None)
        answers["split"] = waves.stop()
        split = _migrations_in(client, "smollm2-s0")
    finally:
        client.request("DELETE", "/system/functions", {"functionName": "smollm2-whole"})
        for stage, name in enumerate(NARROW):
            scale_and_wait(client, r, name, 1, stage=stage)
    assert gathered >= 1 and split >= 1, (gathered, split)
    for phase in ("consolidated", "split"):
        assert [x.status for _, x in answers[phase]] == [200] * len(answers[phase]), \
            [x.body[:200] for _, x in answers[phase] if x.status != 200]
        assert sum(x.json()["recomputes"] for _, x in answers[phase]) == 0, phase
        for index, reply in answers[phase]:
            expected = references[index]
            same_or_near_tie(sources, prompts[index], reply.json()["token_ids"][:len(expected)], expected)
    print(f"caches gathered into the whole replica: {gathered:.0f}; split over the stages: {split:.0f}")


# -- failures ----------------------------------------------------------------------------------

def _wait_for_a_holder(r: redis.Redis, stage: int, forked: bool | None, since: float) -> dict:
    """A live, serving replica of a stage that holds the cache of a request sent after `since`:
    one that ran a decode step since then (a step runs where its sequence's cache is; a count of
    sequences held may be an earlier test's, left to expire on a replica these requests skip)."""
    found: list[dict] = []

    def holds() -> bool:
        store = RedisStore(r)
        decoding = {s.replica_id for s in store.samples("smollm2", stage, since) if s.kind == "decode"}
        found[:] = [x for x in store.live_replicas("smollm2", stage) if x.replica_id in decoding and not x.draining
                    and (forked is None or x.started_by.startswith("fork") == forked)]
        return bool(found)
    wait_until(holds, 60, f"a stage {stage} replica holding a cache")
    return found[0]


@pytest.mark.parametrize("stage,forked", [(2, None), (1, True)])
def test_kill_9_of_a_stage_replica_mid_generation(client, r, sources, tokenizer, prompts, references, stage, forked):
    """The killed replica's caches are gone: its requests prefill again on live replicas (with the
    tokens the entry already holds) and answer once, with the same tokens. (Past the end of text,
    so that every request is still generating when the replica dies.)"""
    if forked:
        scale_and_wait(client, r, "smollm2-s1", 3, stage=1)
        assert any(x.started_by == "fork-cow" for x in RedisStore(r).live_replicas("smollm2", 1))
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in prompts[:4]]
    results: list = []
    sender = threading.Thread(target=lambda: results.extend(
        run_concurrently(lambda t: generate(client, t, ignore_eos=True), [(t,) for t in texts], 4)))
    since = time.time()
    sender.start()
    victim = _wait_for_a_holder(r, stage, forked, since)
    os.kill(victim.pid, signal.SIGKILL)
    sender.join(timeout=300)
    assert [x.status for x in results] == [200] * 4, [x.body for x in results]
    assert sum(x.json()["recomputes"] for x in results) >= 1
    for reply, ids, expected in zip(results, prompts, references):
        same_or_near_tie(sources, ids, reply.json()["token_ids"][:len(expected)], expected)
    if forked:
        scale_and_wait(client, r, "smollm2-s1", 1, stage=1)
    wait_until(lambda: available(client, f"smollm2-s{stage}") >= 1, 120, "the provider to replace the replica")


def _entry_pids(runtime) -> list[int]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "engine.watchdog" in cmd and "functions/entry" in cmd:
            try:
                env = p.environ()
            except psutil.Error:
                continue
            if env.get("QUART_REDIS_PORT") == str(runtime.redis.port) and env.get("QUART_MODEL") == "smollm2":
                found.append(p.pid)
    return found


def test_kill_9_of_the_entry_replica_mid_generation(client, r, runtime, tokenizer, prompts, references):
    """The gateway had no answer yet: it sends the request to the entry's replacement, which
    answers it once, with the same tokens."""
    longest = max(range(len(prompts)), key=lambda i: len(references[i]))
    text = tokenizer.decode(prompts[longest], skip_special_tokens=True)
    before = _entry_pids(runtime)
    assert len(before) == 1
    result: list = []
    sender = threading.Thread(target=lambda: result.append(generate(client, text, ignore_eos=True)))
    since = time.time()
    sender.start()
    _wait_for_a_holder(r, 3, None, since)
    os.kill(before[0], signal.SIGKILL)
    sender.join(timeout=300)
    assert result and result[0].status == 200, result and result[0].body
    assert result[0].json()["token_ids"][:len(references[longest])] == references[longest]
    assert _entry_pids(runtime) and _entry_pids(runtime) != before


@contextmanager
def _entry_with(client: GatewayClient, runtime, **env: str):
    """The smollm2 entry function redeployed with `env` added, until the block ends."""
    deployment = client.request("GET", "/system/function/smollm2").json()
    original = {"service": "smollm2", "image": deployment["image"], "envVars": deployment["envVars"],
                "labels": deployment.get("labels") or {}}

    def replaced(before: list[int]) -> bool:
        now = _entry_pids(runtime)
        return len(now) == 1 and now != before and available(client, "smollm2") >= 1

    before = _entry_pids(runtime)
    assert client.request("PUT", "/system/functions", {**original, "envVars": {**original["envVars"], **env}}).status == 200
    wait_until(lambda: replaced(before), 120, "the redeployed entry")
    try:
        yield
    finally:
        changed = _entry_pids(runtime)
        assert client.request("PUT", "/system/functions", original).status == 200
        wait_until(lambda: replaced(changed), 120, "the original entry")


def test_a_tpot_objective_bounds_what_runs_and_queues_the_rest(client, runtime):
    """A TPOT objective no step here meets (1 ms): once a step is measured the entry lets one
    sequence in flight at a time, and a burst of three is answered in full, the later ones
    having waited at the entry for those before (none refused: without a TTFT objective the
    deadline is the request timeout)."""
    with _entry_with(client, runtime, QUART_TPOT_OBJECTIVE_S="0.001"):
        assert generate(client, "Measure a step.", 4).status == 200
        replies = run_concurrently(lambda i: generate(client, f"Count to {i}.", 12, ignore_eos=True), [(i,) for i in range(3)], 3)
    assert [x.status for x in replies] == [200] * 3, [x.body for x in replies]
    answers = sorted((x.json() for x in replies), key=lambda a: a["queued_ms"])
    runs = sorted(a["latency_ms"] - a["queued_ms"] for a in answers)
    # One at a time: the last waited for (about) the two before it; all at once, none would wait.
    assert answers[-1]["queued_ms"] >= 0.5 * (runs[0] + runs[1]), answers


def test_a_request_predicted_to_miss_its_ttft_objective_gets_429(client, runtime):
    """Objectives no request can meet: the first is let in (nothing measured yet to predict
    from), the next is refused at once with Retry-After, and says why."""
    with _entry_with(client, runtime, QUART_TTFT_OBJECTIVE_S="0.001", QUART_TPOT_OBJECTIVE_S="0.001"):
        assert generate(client, "Measure a step.", 4).status == 200
        refused = generate(client, "Too late already.", 8)
        oai = client.request("POST", "/function/smollm2/v1/completions",
                             {"model": "smollm2", "prompt": "Too late.", "max_tokens": 8})
    assert refused.status == 429 and int(refused.headers["Retry-After"]) >= 1, refused.body
    assert "deadline" in refused.json()["error"]
    assert oai.status == 429 and oai.json()["error"]["message"], oai.body


def test_kv_budget_gives_429_with_retry_after_and_a_disconnect_frees_the_cache(client, r):
    """A stage with room for two requests' caches: a burst of ten gets some 429s with
    Retry-After and the rest answer; the replica keeps running. A client that goes away
    mid-stream frees its caches on every stage."""
    deployment = client.request("GET", "/system/function/smollm2-s2").json()
    original = {"service": "smollm2-s2", "image": deployment["image"], "envVars": deployment["envVars"],
                "labels": deployment.get("labels") or {}}
    before = {x.replica_id for x in RedisStore(r).live_replicas("smollm2", 2)}
    small = {**original, "envVars": {**original["envVars"], "QUART_KV_BYTES": str(2_500_000), "QUART_KV_WAIT_S": "0.5"}}
    assert client.request("PUT", "/system/functions", small).status == 200
    try:
        wait_until(lambda: [x.replica_id not in before for x in RedisStore(r).live_replicas("smollm2", 2)] == [True], 120,
                   "the small-budget replica")
        replica = RedisStore(r).live_replicas("smollm2", 2)[0].replica_id
        replies = run_concurrently(lambda i: generate(client, f"Tell me about the number {i}.", ignore_eos=True),
                                   [(i,) for i in range(10)], 10)
        statuses = [x.status for x in replies]
        assert 429 in statuses and 200 in statuses, statuses
        for x in replies:
            if x.status == 429:
                assert int(x.headers["Retry-After"]) >= 1 and "KV" in x.json()["error"]
        assert [x.replica_id for x in RedisStore(r).live_replicas("smollm2", 2)] == [replica]
        wait_until(lambda: _sequences(r) == 0, 30, "every cache freed after the burst")
        asyncio.run(_stream_then_leave(client, r))
        wait_until(lambda: _sequences(r) == 0 and _kv_bytes(r) == 0, 30, "the disconnected request's caches freed")
    finally:
        assert client.request("PUT", "/system/functions", original).status == 200
        # One read per check: the list changes while the replaced replica goes.
        wait_until(lambda: [x.replica_id != replica for x in RedisStore(r).live_replicas("smollm2", 2)] == [True], 120,
                   "the original stage 2")


def _sequences(r: redis.Redis) -> int:
    return sum(x.sequences for s in range(4) for x in RedisStore(r).live_replicas("smollm2", s))


def _kv_bytes(r: redis.Redis) -> int:
    return sum(x.kv_bytes for s in range(4) for x in RedisStore(r).live_replicas("smollm2", s))


async def _stream_then_leave(client: GatewayClient, r: redis.Redis) -> None:
    """Reads the start of a 64-token stream, then closes the connection: generation stops short
    of 64 tokens (counted at the last stage, once every stage has freed the request's cache)."""
    body = {"model": "smollm2", "prompt": "Write a long story about a lighthouse keeper.", "max_tokens": 64,
            "temperature": 0, "stream": True, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{client.url}/function/smollm2/v1/completions", json=body) as resp:
            assert resp.status == 200 and resp.content_type == "text/event-stream"
            rid = json.loads((await resp.content.readline()).removeprefix(b"data: "))["id"]
            deadline = time.monotonic() + 5
            while _sequences(r) == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert _sequences(r) >= 1, "the stream's caches never showed up"
    # Until its caches are freed: a generation that ignored the disconnect frees them only after
    # its 64th token, so the count below is then 64 however slow the host.
    deadline = time.monotonic() + 120
    while _sequences(r) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    steps = [x for x in RedisStore(r).samples("smollm2", 3) if x.request_id.startswith(rid + ".")]
    assert 1 <= len(steps) < 64, f"{len(steps)} steps: the generation did not stop when its client left"


# -- the OpenAI-compatible API -----------------------------------------------------------------

@pytest.fixture(scope="module")
def oai(runtime) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{runtime.gateway.url}/function/smollm2/v1", api_key="unused", max_retries=0)


def test_openai_client_chat_completion_and_models(oai, sources, tokenizer):
    messages = [{"role": "user", "content": "What is the capital of Italy?"}]
    chat = oai.chat.completions.create(model="smollm2", messages=messages, max_tokens=12, temperature=0)
    ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"])
    expected_ids = reference_greedy(sources, ids, 12)
    assert chat.choices[0].message.content == tokenizer.decode(expected_ids, skip_special_tokens=True)
    assert chat.usage.prompt_tokens == len(ids) and chat.usage.completion_tokens == len(expected_ids)
    assert chat.choices[0].finish_reason in ("stop", "length")
    done = oai.completions.create(model="smollm2", prompt="One, two, three,", max_tokens=20, temperature=0, stop=[" six"])
    assert done.choices[0].finish_reason == "stop" and " six" not in done.choices[0].text
    assert " four" in done.choices[0].text
    assert [m.id for m in oai.models.list().data] == ["smollm2"]


def test_openai_client_streams(oai):
    pieces, usage = [], None
    stream = oai.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Count to ten."}],
                                         max_tokens=16, temperature=0.8, seed=7, stream=True,
                                         stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None and usage.completion_tokens >= 1
    again = oai.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Count to ten."}],
                                        max_tokens=16, temperature=0.8, seed=7)
    # The same seed samples the same tokens, streamed or not.
    assert "".join(pieces) == again.choices[0].message.content
    completion = list(oai.completions.create(model="smollm2", prompt="The sky is", max_tokens=5, stream=True))
    assert completion[-1].choices[0].finish_reason in ("stop", "length")


def test_openai_client_gets_clear_errors(oai):
    with pytest.raises(openai.BadRequestError) as bad:
        oai.completions.create(model="smollm2", prompt="x", max_tokens=10 ** 6)
    assert "max_tokens" in str(bad.value)
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as bad:
        oai.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "hi"}], n=9)
    assert "n:" in str(bad.value)


def test_openai_logprobs_and_several_choices(oai, r, sources, tokenizer):
    """Log-probabilities from the last stage's logits equal the unsplit model's; n choices are n
    sequences sharing one prefill (the others fork its cache), each sampled with its own seed,
    streamed interleaved."""
    messages = [{"role": "user", "content": "What is the capital of Italy?"}]
    chat = oai.chat.completions.create(model="smollm2", messages=messages, max_tokens=4, temperature=0,
                                       logprobs=True, top_logprobs=3)
    ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"])
    with torch.inference_mode():
        expected = torch.log_softmax(sources["smollm2"].model(input_ids=torch.tensor([ids])).logits[0, -1], -1)
    first = chat.choices[0].logprobs.content[0]
    assert abs(first.logprob - float(expected.max())) <= 1e-3 and len(first.top_logprobs) == 3
    assert first.top_logprobs[0].token == first.token == tokenizer.decode([int(expected.argmax())])
    assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens
    done = oai.completions.create(model="smollm2", prompt="One, two,", max_tokens=3, temperature=0, logprobs=2)
    assert len(done.choices[0].logprobs.tokens) == 3 and len(done.choices[0].logprobs.top_logprobs[0]) == 2
    several = oai.chat.completions.create(model="smollm2", messages=messages, max_tokens=8, temperature=1.0,
                                          seed=3, n=3)
    assert [c.index for c in several.choices] == [0, 1, 2]
    assert len({c.message.content for c in several.choices}) > 1  # three seeds, three samples
    prefills = [x for x in RedisStore(r).samples("smollm2", 0)
                if x.request_id.startswith(several.id + "-") and x.kind == "prefill"]
    assert len(prefills) == 1
    greedy = oai.chat.completions.create(model="smollm2", messages=messages, max_tokens=8, temperature=0, n=3)
    assert len({c.message.content for c in greedy.choices}) == 1  # forked caches decode as the prefill's own
    assert greedy.choices[0].message.content == tokenizer.decode(reference_greedy(sources, ids, 8),
                                                                 skip_special_tokens=True)
    streamed: dict[int, str] = {}
    for part in oai.chat.completions.create(model="smollm2", messages=messages, max_tokens=8, temperature=1.0,
                                            seed=3, n=3, stream=True):
        for c in part.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    assert [streamed[i] for i in range(3)] == [c.message.content for c in several.choices]


BAD_OPENAI = [
    ("v1/completions", b"{not json", 400, "malformed JSON"),
    ("v1/completions", {"model": "smollm2", "prompt": 5}, 400, "prompt"),
    ("v1/completions", {"model": "smollm2", "prompt": ""}, 400, "empty"),
    ("v1/completions", {"model": "smollm2", "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("v1/completions", {"model": "smollm2", "prompt": "x", "temperature": float("nan")}, 400, "temperature"),
    ("v1/completions", {"model": "smollm2", "prompt": "x", "stop": [1]}, 400, "stop"),
    ("v1/completions", {"model": "smollm2", "prompt": "word " * 600}, 413, "tokens"),
    ("v1/completions", {"model": "smollm2", "prompt": "x", "echo": True}, 400, "echo"),
    ("v1/chat/completions", {"model": "smollm2", "messages": []}, 400, "messages"),
    ("v1/chat/completions", {"model": "smollm2", "messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
    ("v1/chat/completions", {"model": "other", "messages": [{"role": "user", "content": "x"}]}, 404, "does not exist"),
    ("v1/nothing", {}, 404, "it serves"),
]


@pytest.mark.parametrize("path,body,status,text", BAD_OPENAI)
def test_bad_openai_requests_get_openai_shaped_errors(client, path, body, status, text):
    raw = body if isinstance(body, bytes) else json.dumps(body, allow_nan=True).encode()
    reply = client.request("POST", f"/function/smollm2/{path}", raw, auth=False)
    assert reply.status == status, reply.body
    error = reply.json()["error"]
    assert text in error["message"] and error["type"] and "param" in error and "code" in error
