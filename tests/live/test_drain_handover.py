"""A draining stage replica still takes what an earlier stage forwards while nobody else would:
the race a consolidation runs into when a prefill is on its way through the stages as they drain
(docs/architecture.md, "Consolidation"). Real SmolLM2 stage replicas (in this process, each
with its own threads), a real redis-server, and the entry's own pipeline client."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
import redis

from contracts.stage import StageRef
from engine.replica import StageReplica
from frontend.pipeline_client import PipelineClient, Progress
from models.sampling import Sampling
from state.store import RedisStore
from tests.live.runtime_helpers import reference_greedy, wait_until

NEW_TOKENS = 8


@pytest.fixture
def data_plane(home_settings, partitioned, tmp_path, redis_port):
    """Settings on a redis-server of their own, and the replicas a test starts (stopped after)."""
    partitioned("smollm2", 4)
    settings = home_settings.replace(home=str(tmp_path), models=str(home_settings.models_dir), redis_port=redis_port,
                                     server="drain-test", drain_timeout_s=60.0, reclaim_idle_ms=1000, threads=1)
    replicas: list[StageReplica] = []
    try:
        yield settings, replicas
    finally:
        for replica in replicas:
            if not replica._stop.is_set():
                replica.stop()


def start(settings, replicas: list[StageReplica], first: int, last: int) -> StageReplica:
    replica = StageReplica(settings, StageRef("smollm2", first, last))
    replica.start()
    replicas.append(replica)
    return replica


def stop_in_background(replica: StageReplica) -> threading.Thread:
    """Stops `replica` in a thread of its own (stop() returns once it has drained)."""
    thread = threading.Thread(target=replica.stop, daemon=True)
    thread.start()
    wait_until(lambda: replica._draining, 10, f"{replica.replica_id} draining")
    return thread


def watch_registry(settings, ids: list[str], gone: dict[str, float], done: threading.Event) -> None:
    """Notes when each of `ids` leaves the registry (a replica leaves only once the stage before
    it has, so these times are in stage order). It looks once more after `done` is set, so a
    replica that left just before is still noted."""
    store = RedisStore(redis.Redis.from_url(settings.redis_url))
    while len(gone) < len(ids):
        finished = done.is_set()
        live = {x.replica_id for s in range(4) for x in store.live_replicas("smollm2", s)}
        now = time.monotonic()
        for replica_id in ids:
            if replica_id not in live:
                gone.setdefault(replica_id, now)
        if finished:
            return
        time.sleep(0.01)


def test_a_prefill_forwarded_to_draining_stages_is_answered_and_gathered_into_the_whole_replica(
        data_plane, sources, tokenizer):
    """Stages 1-3 start draining (their functions scaled to zero) while stage 0 still serves; a
    request's prefill then goes through all four and comes back. The whole-model replica starts,
    stage 0 drains too, and the request's next step gathers its cache into the whole replica,
    which answers the rest. Every token is the unsplit model's; nothing prefills again; each
    draining stage leaves only after the stage before it has."""
    settings, replicas = data_plane
    stages = [start(settings, replicas, k, k + 1) for k in range(4)]
    gone: dict[str, float] = {}  # when each stage replica left the registry
    watching = threading.Event()
    watcher = threading.Thread(target=watch_registry, args=(settings, [r.replica_id for r in stages], gone, watching),
                               daemon=True)
    watcher.start()
    stoppers = [stop_in_background(replica) for replica in stages[1:]]
    prompt = tokenizer("The capital of France is")["input_ids"]
    expected = reference_greedy(sources, prompt, NEW_TOKENS)

    async def generate() -> tuple[list[int], Progress, StageReplica]:
        # The entry sends each step (not the last stage): the second waits while the test starts
        # the whole replica and drains stage 0.
        client = PipelineClient(settings.replace(chain_steps=False), "smollm2", "drain-test-entry")
        progress = Progress()
        tokens = client.generate("r1", prompt, NEW_TOKENS, Sampling(), time.time() + 120, progress)
        # Without a draining replica reading on, the prefill would wait in stage 1's stream.
        got = [await asyncio.wait_for(anext(tokens), 90)]
        assert not gone, f"a draining stage left while stage 0 still served: {gone}"
        whole = await asyncio.to_thread(start, settings, replicas, 0, 4)
        stoppers.append(await asyncio.to_thread(stop_in_background, stages[0]))
        got += [token async for token in tokens]
        await client.aclose()  # the free of r1's cache reaches the whole replica
        return got, progress, whole

    got, progress, whole = asyncio.run(generate())
    wait_until(lambda: not whole.generation.store.sequences, 10, "the whole replica to free r1's cache")
    for thread in stoppers:
        thread.join(timeout=90)
    assert not any(thread.is_alive() for thread in stoppers), "a draining stage did not stop within 90 s"
    watching.set()
    watcher.join(timeout=10)
    assert got == expected[:len(got)] and len(got) == min(NEW_TOKENS, len(expected)), (got, expected)
    assert progress.recomputes == 0
    last_step = {t.replica for t in progress.timings[-1]}
    assert last_step == {whole.replica_id}, f"the last step ran on {last_step}, not the whole replica"
    order = [gone.get(replica.replica_id) for replica in stages]
    assert None not in order and order == sorted(order), f"stages left out of order: {order}"
    store = RedisStore(redis.Redis.from_url(settings.redis_url))
    assert [x.replica_id for s in range(4) for x in store.live_replicas("smollm2", s)] == [whole.replica_id] * 4
    assert all(store.backlog("smollm2", s).waiting == 0 for s in range(4))
