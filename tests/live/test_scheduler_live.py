"""The scheduler on the embedded runtime with three virtual servers, each with its own slots,
cache budget and KeysManager, and the emulated 8-stage LLaMA-7B pipeline (its uneven variant): a burst makes stage 3
the key stage; its new replicas fork on servers that cache it and spread over servers."""
from __future__ import annotations

import time
from collections import Counter

import pytest
import redis

from contracts.stage import StageRef
from keysmanager.client import KeysClient, KeysManagerError
from state import keys
from state.records import ColdStart, Placement, StageSample
from state.store import RedisStore
from tests.live.test_autoscaler_live import MODEL, burst, emulated_settings

STAGE3 = f"{MODEL}:3"


@pytest.fixture(scope="module")
def three_servers(home_settings, tmp_path_factory):
    from runtime import __main__ as control
    settings = emulated_settings(
        home_settings, tmp_path_factory.mktemp("servers"), server="vs", virtual_servers=3, server_slots=12,
        # Room for stage 3 (2.8 GB nominal) and five other key stages (1.4-1.75 GB each): a
        # burst's first key stages do not push the stage 3 cache out before stage 3 needs it.
        server_cache_bytes=int(12e9),
        cache_stages=STAGE3)  # cached at start on the first server only
    try:
        assert control.up(settings, timeout=600) == 0
        clients = [KeysClient.for_settings(settings.replace(keysmanager_port=settings.cache.port + i), timeout=120) for i in range(3)]
        clients[1].cache(StageRef.parse(MODEL, "3"))  # pre-warmed by hand on a second server
        deadline = time.time() + 120
        while not any(z["stages"] == "3" for z in clients[0].zygotes()) and time.time() < deadline:
            time.sleep(0.5)
        yield settings, redis.Redis.from_url(settings.redis_url), clients
    finally:
        control.down(settings)


def placements(r: redis.Redis) -> list[Placement]:
    return RedisStore(r).placements()


def test_initial_replicas_are_packed_and_every_placement_is_recorded(three_servers):
    settings, r, clients = three_servers
    added = [p for p in placements(r) if p.op == "add"]
    assert len(added) == 9  # 8 stages and the entry function
    assert Counter(p.server for p in added) == {"vs-0": 9}, "best fit packs the first server"
    assert all(p.reason for p in added)
    assert [c.stats()["server"] for c in clients] == ["vs-0", "vs-1", "vs-2"]
    # The budget holds: the whole model (14 GB nominal) does not fit, and nothing is evicted trying.
    with pytest.raises(KeysManagerError) as refused:
        clients[1].cache(StageRef.parse(MODEL, "0-8"))
    assert refused.value.status == 507
    assert [z["stages"] for z in clients[1].zygotes()] == ["3"]


def test_a_burst_forks_the_key_stage_on_servers_that_cache_it_and_spreads_it(three_servers):
    settings, r, clients = three_servers
    before = len(placements(r))
    statuses = burst(f"{settings.gateway.url}/function/{MODEL}", rate=30, seconds=15)
    assert statuses == [200] * len(statuses), {s: statuses.count(s) for s in set(statuses)}
    grown = [p for p in placements(r)[before:] if p.op == "add" and p.stage == STAGE3]
    assert grown, "stage 3 was not scaled up"
    # A replica forks only where the scheduler saw the stage cached (a fork that fails there, say
    # the zygote went away meanwhile, falls back to a cold start on the same server).
    forks = [p for p in grown if p.started_by == "fork-cow"]
    assert forks and all(p.path == "fork" for p in forks), grown
    cached_at_fork = {
        server: {e.zygote for e in RedisStore(r).cache_events(server) if e.event == "cache"}
        for server in ("vs-0", "vs-1", "vs-2")}
    assert all(STAGE3 in cached_at_fork[p.server] for p in forks)
    # The key stage's replicas (its first one on vs-0 included) sit on more than one server.
    servers = {p.server for p in grown} | {"vs-0"}
    assert len(servers) >= 2, grown


def test_a_ttft_objective_sets_the_cold_start_fetch_deadline_from_what_was_measured(r, runtime):
    """The placer's deadline for a cold start of a stage labelled com.quart.ttft-slo: the objective
    less the stage's measured load after its fetch and the model's median prefill pass, read from
    a real Redis; a stage without the label keeps QUART_COLD_DEADLINE_S."""
    from pathlib import Path

    from runtime.functions import FunctionState
    from runtime.placer import Placer

    model = "deadline-test"
    stages = [StageRef(model, 0, 1), StageRef(model, 1, 2)]
    r.delete(keys.coldstarts(model), *[keys.records_stream(model, s.first) for s in stages])
    RedisStore(r).record_cold_start(stages[1], ColdStart(fetched_at=100.0, loaded_at=101.5))
    for stage, service_ms in ((0, (200, 300, 400)), (1, (100, 700, 900))):
        for ms in service_ms:
            r.xadd(keys.records_stream(model, stage), StageSample("x.0.0", 0.0, 0.0, ms, "r", "prefill").encode())
        r.xadd(keys.records_stream(model, stage), StageSample("x.0.1", 0.0, 0.0, 9000, "r", "decode").encode())

    def function(stage: StageRef, labels: dict) -> FunctionState:
        return FunctionState({"service": f"{model}-s{stage.first}", "image": "quart/stage:0.1.0", "labels": labels,
                              "envVars": {"QUART_MODEL": model, "QUART_STAGES": stage.stages}}, Path("."), 1)

    labelled = [function(s, {"com.quart.ttft-slo": "10s"}) for s in stages]
    placer = Placer(runtime, None, RedisStore(r))
    assert placer.deadline_s(labelled[1], labelled) == pytest.approx(10 - 1.5 - 0.3 - 0.7)
    assert placer.deadline_s(labelled[0], labelled) == pytest.approx(10 - 0.3 - 0.7)  # no cold start recorded
    plain = function(stages[0], {})
    assert placer.deadline_s(plain, [plain]) == runtime.servers.cold_deadline_s
    tight = [function(s, {"com.quart.ttft-slo": "500ms"}) for s in stages]
    assert placer.deadline_s(tight[1], tight) == 1.0  # never under the floor
    r.delete(keys.coldstarts(model), *[keys.records_stream(model, s.first) for s in stages])
