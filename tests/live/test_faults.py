"""Faults in the embedded runtime's own components, on a runtime of its own (emulated 8-stage
LLaMA-7B): Redis refuses clients without the password; Redis killed -9 during load comes back
(supervised, from its append-only file) and the data plane recovers by itself, every request
answered once with its content or a clear 503/504; a KeysManager killed -9 comes back and its
orphaned zygotes exit; so does a killed autoscaler; a stage replica killed -9 is taken out of the
registry by the provider that reaped it, and the requests it held prefill again; a provider
killed -9 is started again and adopts what runs; with the guardian itself killed, `down` still
stops everything."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import redis

from contracts.http_client import GatewayClient
from contracts.stage import StageRef
from keysmanager.client import KeysClient
from loadgen.closed_loop import ClosedLoop
from runtime import __main__ as control
from runtime.ports import free_port
from runtime.watched_process import start_time
from state import keys
from state.store import RedisStore
from tests.conftest import REPO
from tests.live.runtime_helpers import wait_until

MODEL = "llama-7b"


@pytest.fixture(scope="module")
def faulty(home_settings, tmp_path_factory):
    settings = home_settings.replace(
        home=str(tmp_path_factory.mktemp("faults")), models=str(home_settings.models_dir),
        stack_file=str(REPO / "stack-emulated.yml"), gateway_port=free_port(), redis_port=free_port(),
        keysmanager_port=free_port(), policy="static", cache_stages="none", request_timeout_s=30.0,
        reclaim_idle_ms=2000)
    try:
        assert control.up(settings, timeout=600) == 0
        yield settings
    finally:
        control.down(settings)


def components(settings) -> dict:
    """The supervised components as /healthz shows them (200 or 503)."""
    return GatewayClient(settings.gateway.url).request("GET", "/healthz", auth=False).json()["components"]


def pid_of(settings, fragment: str) -> int:
    (pid,) = [pid for pid, cmd in control.processes(settings).items() if fragment in cmd]
    return pid


def alive(pid: int) -> bool:
    return start_time(pid) is not None  # a zombie is dead too


def test_redis_refuses_clients_without_the_password(faulty):
    anonymous = redis.Redis(host=faulty.redis.host, port=faulty.redis.port)
    with pytest.raises(redis.AuthenticationError):
        anonymous.ping()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host=faulty.redis.host, port=faulty.redis.port, password="guess").ping()
    assert redis.Redis.from_url(faulty.redis_url).ping()
    assert oct(faulty.redis_password_file.stat().st_mode & 0o777) == "0o600"


def test_redis_killed_during_load_comes_back_and_the_data_plane_recovers(faulty):
    client = GatewayClient.for_settings(faulty)
    r = redis.Redis.from_url(faulty.redis_url)
    replicas_before = {x.replica_id for s in range(8) for x in RedisStore(r).live_replicas(MODEL, s)}
    before = pid_of(faulty, "redis-server")
    with ClosedLoop(faulty.gateway.url, MODEL, {"tokens": 16}) as load:
        wait_until(lambda: sum(o.status == 200 for o in load.outcomes) >= 5, 60, "answers before the fault")
        os.kill(before, signal.SIGKILL)
        killed = time.monotonic()
        wait_until(lambda: components(faulty)["redis"]["restarts"] == 1 and client.healthy(), 60, "Redis started again")
        wait_until(lambda: load.ok_after(killed + 1) is not None, 90, "an answer to a request sent after the fault")
        time.sleep(2)
    assert components(faulty)["redis"]["running"] and pid_of(faulty, "redis-server") != before
    # From its append-only file: the stage streams' consumer groups were there at once.
    assert r.xinfo_groups(keys.stage_stream(MODEL, 0))
    # Every request answered once: its content, or a clear error naming the outage or the deadline.
    for o in load.outcomes:
        assert o.status in (200, 503, 504), o
        if o.status == 200:
            assert o.body["emulated"] and o.body["tokens"] == 16 and len(o.body["stages"]) == 8, o
        else:
            assert "error" in o.body, o
    # Nothing was replaced: the replicas that were serving found Redis again by themselves.
    replicas_after = {x.replica_id for s in range(8) for x in RedisStore(r).live_replicas(MODEL, s)}
    assert replicas_after == replicas_before
    assert client.invoke(MODEL, {"tokens": 16}).status == 200


def test_a_killed_keysmanager_comes_back_and_its_zygotes_do_not_linger(faulty):
    keys_client = KeysClient.for_settings(faulty, timeout=120)
    keys_client.cache(StageRef(MODEL, 2, 3))
    zygote = next(z for z in keys_client.zygotes() if z["stages"] == "2")["pid"]
    os.kill(pid_of(faulty, "-m keysmanager "), signal.SIGKILL)
    wait_until(lambda: components(faulty)["keysmanager"]["restarts"] == 1 and keys_client.healthy(), 60,
               "the KeysManager started again")
    wait_until(lambda: not alive(zygote), 30, "the orphaned zygote gone")
    assert keys_client.zygotes() == []   # it starts empty; key stages are cached again as named
    assert GatewayClient.for_settings(faulty).invoke(MODEL, {"tokens": 16}).status == 200


def test_a_killed_autoscaler_comes_back_and_decides_again(faulty):
    r = redis.Redis.from_url(faulty.redis_url)
    before = pid_of(faulty, "-m autoscaler run")
    os.kill(before, signal.SIGKILL)
    wait_until(lambda: components(faulty)["autoscaler"]["restarts"] == 1 and GatewayClient(faulty.gateway.url).healthy(),
               60, "the autoscaler started again")
    assert pid_of(faulty, "-m autoscaler run") != before
    restarted = time.time()
    # The one started again makes decisions (the static policy's, every tick) as the first did.
    wait_until(lambda: RedisStore(r).decisions(MODEL, count=1)[0].t > restarted, 30,
               "a decision by the restarted autoscaler")


def test_a_killed_stage_replica_is_taken_out_of_the_registry_and_its_requests_recover(faulty):
    store = RedisStore.from_url(faulty.redis_url)
    (victim,) = store.live_replicas(MODEL, 5)
    with ClosedLoop(faulty.gateway.url, MODEL, {"tokens": 16}) as load:
        wait_until(lambda: sum(o.status == 200 for o in load.outcomes) >= 5, 60, "answers before the fault")
        os.kill(victim.pid, signal.SIGKILL)
        killed = time.monotonic()
        wait_until(lambda: store.replica(victim.replica_id) is None, 60, "the dead replica gone from the registry")
        wait_until(lambda: load.ok_after(killed) is not None, 90, "an answer to a request sent after the fault")
    # Taken out by the provider that reaped it, not left to expire (QUART_REPLICA_TTL_S).
    log = (Path(faulty.home) / "logs" / "runtime.log").read_text(errors="replace")
    assert f"{victim.replica_id} exited: taken out of the registry" in log
    # And the record of what ran where says it exited, killed (a SIGKILL's code).
    exits = [p for p in store.placements() if p.op == "exit" and p.replica == f"{victim.server}/{victim.pid}"]
    assert [(p.server, p.reason) for p in exits] == [(victim.server, "exited with code -9")], store.placements()
    # The live set, which routing reads, agrees.
    assert victim.replica_id not in {r.replica_id for r in store.live_replicas(MODEL, 5)}
    # Every request answered with its content: those the dead replica held prefilled again.
    assert load.outcomes and all(o.status == 200 and o.body["tokens"] == 16 for o in load.outcomes), \
        [o for o in load.outcomes if o.status != 200]


def test_a_killed_provider_is_started_again_and_adopts_what_runs(faulty):
    client = GatewayClient.for_settings(faulty)
    r = redis.Redis.from_url(faulty.redis_url)
    replicas_before = {x.replica_id for s in range(8) for x in RedisStore(r).live_replicas(MODEL, s)}
    others_before = {pid for pid, cmd in control.processes(faulty).items() if "runtime.server" not in cmd}
    provider = pid_of(faulty, "runtime.server")
    with ClosedLoop(faulty.gateway.url, MODEL, {"tokens": 16}) as load:
        wait_until(lambda: sum(o.status == 200 for o in load.outcomes) >= 5, 60, "answers before the fault")
        os.kill(provider, signal.SIGKILL)
        killed = time.monotonic()
        wait_until(lambda: load.ok_after(killed) is not None, 60, "an answer to a request sent after the fault")
        time.sleep(2)
    assert pid_of(faulty, "runtime.server") != provider
    assert components(faulty)["provider"]["restarts"] == 1
    assert "SIGKILL" in components(faulty)["provider"]["last_exit"]
    # Every request sent after the kill was answered with its content; of those the dead provider
    # had accepted, each lost at most its connection (one per client).
    after = [o for o in load.outcomes if o.sent > killed]
    assert after and all(o.status == 200 and o.body["tokens"] == 16 for o in after), after
    assert all(o.status in (0, 200) for o in load.outcomes), [o for o in load.outcomes if o.status not in (0, 200)]
    assert sum(o.status == 0 for o in load.outcomes) <= 3
    # Adopted, not started again: the same replicas, Redis, KeysManager and zygotes.
    assert {x.replica_id for s in range(8) for x in RedisStore(r).live_replicas(MODEL, s)} == replicas_before
    assert others_before <= set(control.processes(faulty))
    assert client.functions() and all(f["availableReplicas"] == f["replicas"] for f in client.functions())


def test_down_stops_everything_even_when_the_guardian_is_gone(faulty):
    """Last in this module: it ends the runtime."""
    pid = int((Path(faulty.home) / control.PID_FILE).read_text())
    group = list(control.processes(faulty))
    assert len(group) > 5   # the guardian, the provider, Redis, the KeysManager, the replicas
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not alive(pid), 10, "the guardian gone")
    assert control.down(faulty) == 0
    wait_until(lambda: not any(alive(p) for p in group), 30, "every process of the runtime gone")
