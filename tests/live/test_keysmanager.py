"""The KeysManager with real zygote processes, real forks, a real redis-server and real weights."""
from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from contracts.config import Settings
from contracts.http_client import HttpClient
from contracts.paths import STAGE_HANDLER
from contracts.secrets import bearer
from contracts.stage import StageRef
from contracts.wire import decode_tensors, encode_tensors
from keysmanager.client import KeysClient, KeysManagerError
from models.fetch import FetchError, ensure_model
from models.manifest import Manifest, sha256_file
from models.partition import partition
from models.stage_runner import StageRunner
from runtime.functions import start_watchdog
from state.records import ReplicaRecord
from state.store import RedisStore
from tests.live.conftest import keysmanager
from tests.live.runtime_helpers import wait_until


def _kill(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def start_forked(client: KeysClient, children: list, model: str, stages: str, cow: bool = True) -> tuple[int, int]:
    answer = client.fork(StageRef.parse(model, stages), f"{model}-s{stages}", cow=cow)
    children.append(answer["pid"])
    port_file = Path(answer["port_file"])
    wait_until(port_file.exists, 60, "the forked replica to listen")
    return answer["pid"], ready(int(port_file.read_text()))


def ready(port: int) -> int:
    """A replica listens before it has loaded its handler: until /_/ready says it has."""
    wait_until(lambda: HttpClient(f"http://127.0.0.1:{port}").healthy("/_/ready"), 180, "the replica ready")
    return port


def start_cold(settings: Settings, children: list, model: str, stages: str) -> int:
    port_file = Path(settings.home) / "run" / f"cold-{model}-{stages}.port"
    port_file.parent.mkdir(parents=True, exist_ok=True)
    port_file.unlink(missing_ok=True)
    proc = start_watchdog(settings, STAGE_HANDLER, {"QUART_MODEL": model, "QUART_STAGES": stages}, port_file,
                          Path(settings.home) / "logs" / "cold.log")
    children.append(proc.pid)
    wait_until(port_file.exists, 120, "the cold replica to listen")
    return ready(int(port_file.read_text()))


def invoke(client: KeysClient, port: int, tensors: dict) -> dict:
    """A direct invoke of a replica, with the internal token that `client` holds too."""
    reply = HttpClient(f"http://127.0.0.1:{port}").request("POST", "/", encode_tensors(tensors),
                                                          headers={"Authorization": client.auth})
    assert reply.status == 200, reply.body
    return decode_tensors(reply.body)


def pss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no Pss line")


def test_forked_replicas_compute_exactly_what_a_cold_one_does(km, partitioned):
    settings, client, r, children = km
    client.cache(StageRef.parse("smollm2", "1"))
    manifest = partitioned("smollm2", 4)
    hidden = StageRunner(manifest, 0, 1, dtype="float32").run({"input_ids": torch.tensor([[504, 3575, 282, 4649, 314]])})
    _, cow_port = start_forked(client, children, "smollm2", "1", cow=True)
    _, copy_port = start_forked(client, children, "smollm2", "1", cow=False)
    cold_port = start_cold(settings, children, "smollm2", "1")
    cold = invoke(client, cold_port, hidden)["hidden"]
    assert torch.equal(invoke(client, cow_port, hidden)["hidden"], cold)
    assert torch.equal(invoke(client, copy_port, hidden)["hidden"], cold)
    started = sorted(x.started_by for x in RedisStore(r).live_replicas("smollm2", 1))
    assert started == ["cold", "fork-copy", "fork-cow"]


def test_a_cold_replica_forked_from_the_runtime_zygote_loads_its_own_shard(km, partitioned):
    settings, client, r, children = km
    manifest = partitioned("smollm2", 4)
    hidden = StageRunner(manifest, 0, 2, dtype="float32").run({"input_ids": torch.tensor([[504, 3575, 282, 4649, 314]])})
    answer = client.start_cold(StageRef.parse("smollm2", "2"), "smollm2-s2")
    children.append(answer["pid"])
    assert answer["started_by"] == "cold"
    wait_until(Path(answer["port_file"]).exists, 120, "the replica to listen")
    got = invoke(client, int(Path(answer["port_file"]).read_text()), hidden)["hidden"]
    # (this process sums with more threads than the replica's one: equal up to summation order)
    torch.testing.assert_close(got, StageRunner(manifest, 2, 3, dtype="float32").run(hidden)["hidden"], rtol=1e-4, atol=1e-3)
    mine = [x for x in RedisStore(r).live_replicas("smollm2", 2) if x.pid == answer["pid"]]
    assert [x.started_by for x in mine] == ["cold"]   # it read its shard itself: no zygote holds stage 2
    assert "smollm2:2" not in {f"{z['model']}:{z['stages']}" for z in client.zygotes()}
    assert any(f["pid"] == answer["pid"] for f in client.forks())  # drained and stopped like any fork
    assert client.request("POST", "/start", {"model": "no-such-model", "stages": "0"}).status == 404


def test_forks_are_listed_and_stopped_through_the_api(km):
    """On a cluster the autoscaler sees and ends forked replicas only through the KeysManager."""
    settings, client, r, children = km
    client.cache(StageRef.parse("smollm2", "3"))
    pid, _ = start_forked(client, children, "smollm2", "3")
    mine = [f for f in client.forks() if f["pid"] == pid]
    assert [(f["function"], f["model"], f["stages"], f["started_by"]) for f in mine] == \
        [("smollm2-s3", "smollm2", "3", "fork-cow")]
    assert client.stop(pid) == {"stopped": pid}
    wait_until(lambda: all(f["pid"] != pid for f in client.forks()), 60, "the stopped fork to end")
    with pytest.raises(KeysManagerError) as err:
        client.stop(pid)
    assert err.value.status == 404
    with pytest.raises(KeysManagerError) as err:
        client.stop(os.getpid())  # a process it did not fork
    assert err.value.status == 404
    assert client.request("POST", "/stop", {"pid": "1"}).status == 400


def test_cow_children_share_the_zygote_pages(km):
    settings, client, r, children = km
    zygote = client.cache(StageRef.parse("smollm2", "2"))
    start_cold(settings, children, "smollm2", "2")
    cold_pid = children[-1]
    pids = [start_forked(client, children, "smollm2", "2")[0] for _ in range(4)]
    forked_total = sum(pss_bytes(p) for p in pids) + pss_bytes(zygote["pid"])
    cold = pss_bytes(cold_pid)
    # Four cold replicas would hold four private copies; the zygote (about one cold replica) and
    # its four children together hold far less: each child adds under a quarter of its parameters.
    assert forked_total < 0.5 * 4 * cold, (forked_total, cold)
    assert (forked_total - cold) / 4 < 0.25 * zygote["bytes"], (forked_total, cold, zygote["bytes"])
    for pid in pids + [cold_pid]:
        _kill(pid, signal.SIGTERM)


def test_eviction_under_a_lowered_threshold_is_lru_and_spares_children(km):
    settings, client, r, children = km
    for stages in ("0", "1", "2"):
        client.cache(StageRef.parse("minilm", stages))
    _, child_port = start_forked(client, children, "minilm", "0")  # minilm:0 is now the most recent
    since = RedisStore(r).cache_events(settings.server)[-1].t
    client.set_threshold(0.0)
    try:
        wait_until(lambda: not any(z["model"] == "minilm" for z in client.zygotes()), 60, "eviction")
    finally:
        client.set_threshold(0.85)
    evicted = [e.zygote for e in RedisStore(r).cache_events(settings.server, since_s=since)
               if e.event == "evict" and e.zygote.startswith("minilm:")]
    assert evicted == ["minilm:1", "minilm:2", "minilm:0"]
    # The child of an evicted zygote still serves.
    out = invoke(client, child_port, {"input_ids": torch.tensor([[101, 7592, 102]])})
    assert out["hidden"].shape == (1, 3, 384)


def test_a_crashed_zygote_is_noticed_and_cached_again(km):
    settings, client, r, children = km
    before = client.cache(StageRef.parse("minilm", "2"))
    killed_at = time.time()
    os.kill(before["pid"], signal.SIGKILL)
    after = wait_until(lambda: next((z for z in client.zygotes()
                                     if z["model"] == "minilm" and z["stages"] == "2" and z["pid"] != before["pid"]),
                                    None), 120, "the zygote to be cached again")
    assert after["sha256"] == before["sha256"]
    crash = [e.t for e in RedisStore(r).cache_events(settings.server) if e.event == "crash" and e.t >= killed_at]
    # Noticed at the watcher's next pass, which comes every second (3 s allowed on a busy machine).
    assert crash and crash[0] - killed_at < 3.0, crash


def test_a_changed_shard_is_never_served_from_the_stale_cache(km, sources, home_settings):
    settings, client, r, children = km
    out = home_settings.model_dir("minilm-swap")
    partition(sources["minilm"].checkpoint, 3, out, "balanced")
    old = client.cache(StageRef.parse("minilm-swap", "1"))
    partition(sources["minilm"].checkpoint, 3, out, "uniform")  # stage 1 now holds other layers
    with pytest.raises(KeysManagerError) as info:
        client.fork(StageRef.parse("minilm-swap", "1"), "minilm-swap-s1")
    assert info.value.status == 409
    assert not any(z["model"] == "minilm-swap" for z in client.zygotes())
    new = client.cache(StageRef.parse("minilm-swap", "1"))
    assert new["sha256"] != old["sha256"]
    _, port = start_forked(client, children, "minilm-swap", "1")
    from models.manifest import Manifest
    manifest = Manifest.load(out)
    hidden = StageRunner(manifest, 0, 1, dtype="float32").run({"input_ids": torch.tensor([[101, 7592, 2088, 102]])})
    torch.testing.assert_close(invoke(client, port, hidden)["hidden"], StageRunner(manifest, 1, 2, dtype="float32").run(hidden)["hidden"],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("body,status", [
    ({"model": "smollm2"}, 400), ({"model": "../etc", "stages": "1"}, 400), ({"model": "smollm2", "stages": "9"}, 400),
    ({"model": "nope", "stages": "1"}, 404),
])
def test_bad_cache_requests(km, body, status):
    _, client, _, _ = km
    assert client.request("POST", "/cache", body).status == status


def test_metrics_of_the_cache_the_forks_and_the_forked_replicas_parse(km):
    """One scrape per node, without the token (nothing it serves acts): the KeysManager's cache
    and forks, and its forked replicas' own metrics labelled with their function and pid."""
    settings, client, r, children = km
    stage = StageRef.parse("smollm2", "0")
    client.cache(stage)
    try:
        pid, _ = start_forked(client, children, "smollm2", "0")
        anonymous = HttpClient(client.url)

        def families(path: str) -> list:
            reply = anonymous.request("GET", path)
            assert reply.status == 200, reply.body
            return list(text_string_to_metric_families(reply.body.decode()))

        def samples(path: str) -> list:
            return [s for family in families(path) for s in family.samples]

        own = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in samples("/metrics")}
        assert own[("quart_keysmanager_events_total", (("event", "fork"), ("stage", "smollm2:0")))] >= 1
        assert own[("quart_keysmanager_fork_seconds_count", (("started_by", "fork-cow"),))] >= 1
        assert own[("quart_keysmanager_zygotes", ())] >= 1 and own[("quart_keysmanager_forked_replicas", ())] >= 1
        gathered = families("/metrics/replicas")
        mine = [s for f in gathered for s in f.samples if s.labels.get("pid") == str(pid)]
        assert mine and {s.labels["function"] for s in mine} == {"smollm2-s0"}   # its process_* samples
        assert {"quart_stage_requests", "quart_stage_inflight"} <= {f.name for f in gathered}   # a stage's families
        _kill(pid, signal.SIGTERM)
    finally:
        client.evict(stage)


def test_the_api_refuses_callers_without_the_internal_token(km):
    settings, client, _, _ = km
    anonymous = HttpClient(client.url)
    body = {"model": "smollm2", "stages": "1", "env": {"QUART_MAX_BATCH": "1"}}
    for method, path in [("POST", "/fork"), ("POST", "/cache"), ("POST", "/evict"), ("PUT", "/config"),
                         ("GET", "/zygotes"), ("GET", "/stats")]:
        for auth in ({}, {"Authorization": "Bearer not-it"}):
            reply = anonymous.request(method, path, body, headers=auth)
            assert reply.status == 401 and "internal token" in reply.json()["error"], (method, path, reply.body)
    assert anonymous.healthy()  # the probe stays open
    assert client.stats()["memory_threshold"] == settings.cache.memory_threshold


def test_bad_fork_requests(km):
    _, client, _, _ = km
    assert client.request("POST", "/fork", {"model": "smollm2", "stages": "3"}).status == 404  # not cached
    client.cache(StageRef.parse("smollm2", "1"))
    bad_env = {"model": "smollm2", "stages": "1", "env": {"LD_PRELOAD": "/tmp/x.so"}}
    assert client.request("POST", "/fork", bad_env).status == 400
    assert client.request("POST", "/fork", b"{oops").status == 400
    assert client.request("PUT", "/config", {"memory_threshold": 2}).status == 400


def test_key_stages_published_by_the_autoscaler_get_cached_where_they_run(km):
    settings, client, r, children = km
    cached = lambda: any(z["model"] == "minilm" and z["stages"] == "1" for z in client.zygotes())  # noqa: E731
    assert not cached()
    store = RedisStore(r)
    store.publish_key_stages("minilm", (StageRef("minilm", 1, 2),))
    elsewhere = ReplicaRecord("minilm-s1.other.1", "minilm", 1, 2, "another-server", 1, started_at=time.time())
    here = ReplicaRecord("minilm-s1.here.2", "minilm", 1, 2, settings.server, 2, started_at=time.time())
    try:
        # A key stage with a replica only on another server is not cached here (QUART §6.1) ...
        store.register(elsewhere, 60)
        time.sleep(3)  # three watch periods
        assert not cached()
        # ... and is once one is scheduled here.
        store.register(here, 60)
        wait_until(cached, 120, "the key stage to be cached")
    finally:
        store.publish_key_stages("minilm", ())
        store.deregister(elsewhere)
        store.deregister(here)


def test_a_replica_fetches_only_its_shards_from_the_keysmanager(km, tmp_path) -> None:
    settings, _, _, _ = km
    source = settings.model_dir("smollm2")
    here = settings.replace(models=str(tmp_path / "models"),
                            models_url=f"http://127.0.0.1:{settings.cache.port}")
    directory = ensure_model(here, "smollm2", range(1, 3))
    manifest = Manifest.load(directory)
    assert sorted(p.name for p in directory.glob("*.safetensors")) == [manifest.stages[1].shard, manifest.stages[2].shard]
    for i in (1, 2):
        assert sha256_file(manifest.shard_path(i)) == manifest.stages[i].sha256
    assert sorted(p.name for p in manifest.tokenizer_path().iterdir()) == \
        sorted(p.name for p in (source / "tokenizer").iterdir())
    assert ensure_model(here, "smollm2", range(1, 3)) == directory  # complete: nothing fetched again
    StageRunner(manifest, 1, 3, "cpu", "float32")                  # and it loads


def test_a_fetch_refuses_a_bad_shard_a_bad_token_and_paths_outside_the_model(km, tmp_path) -> None:
    settings, _, _, _ = km
    url = f"http://127.0.0.1:{settings.cache.port}"
    tampered = settings.model_dir("smollm2-tampered")
    shutil.copytree(settings.model_dir("smollm2"), tampered)
    try:
        with open(tampered / Manifest.load(tampered).stages[0].shard, "r+b") as f:
            f.seek(-4, os.SEEK_END)
            f.write(b"\0\0\0\1")
        here = settings.replace(models=str(tmp_path / "a"), models_url=url)
        with pytest.raises(FetchError, match="sha256"):
            ensure_model(here, "smollm2-tampered", range(0, 1))
        assert not list((tmp_path / "a").rglob("*.safetensors"))
    finally:
        shutil.rmtree(tampered)
    with pytest.raises(FetchError, match="401"):
        ensure_model(settings.replace(models=str(tmp_path / "b"), models_url=url, internal_token="wrong"), "smollm2")
    client, auth = HttpClient(url), bearer(settings.internal_api_token())
    assert client.request("GET", "/models/smollm2/..%2Fminilm%2Fmanifest.json", headers=auth).status == 404
    assert client.request("GET", "/models/smollm2/../minilm/manifest.json", headers=auth).status == 404
    assert client.request("GET", "/models/no-such-model", headers=auth).status == 404


def test_a_zygote_not_ready_in_time_is_a_504_naming_the_limit(home_settings, partitioned, tmp_path, redis_port):
    partitioned("smollm2", 4)
    # A zygote imports torch and loads its shard: far longer than 0.2 s anywhere.
    with keysmanager(home_settings, tmp_path, redis_port, zygote_start_s=0.2) as (_, client):
        with pytest.raises(KeysManagerError) as refused:
            client.cache(StageRef.parse("smollm2", "0-1"))
    assert refused.value.status == 504 and "QUART_ZYGOTE_START_S" in str(refused.value), refused.value
