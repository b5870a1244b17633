"""λScale's multicast between KeysManagers (keysmanager/blocks.py, runtime/multicast.py): four
servers, each a KeysManager process of its own on its own port with its own models folder and
prefetch folder, their uplinks paced to a link speed; one holds SmolLM2 partitioned in 4 stages
(and is the others' model store, for the manifest). Real processes, real sockets, real hashes."""
from __future__ import annotations

import hashlib
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from contracts.config import Settings, child_environment
from contracts.paths import REPO_ROOT
from contracts.stage import StageRef
from keysmanager.client import KeysClient
from models.manifest import PIECE_BYTES, Manifest
from models.shard_reader import start_readers
from runtime import multicast
from runtime.ports import free_port
from scheduler.multicast import binary_tree_plan, plan, unicast_plan
from tests.live.runtime_helpers import wait_until

MODEL = "smollm2"
TOKEN = "multicast-test-token"
SECONDS_PER_SHARD = 4.0  # a link sends one shard in about this long


@dataclass
class Servers:
    manifest: Manifest
    settings: dict[str, Settings]
    clients: dict[str, KeysClient]
    procs: dict[str, subprocess.Popen]

    def received(self, name: str, shard: str) -> Path:
        return self.settings[name].prefetch_dir(name) / MODEL / shard

    def launch(self, name: str) -> None:
        log = open(Path(self.settings[name].home) / "keysmanager.log", "ab")
        self.procs[name] = subprocess.Popen([sys.executable, "-m", "keysmanager"], env=child_environment(self.settings[name]),
                                            cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
        wait_until(self.clients[name].healthy, 60, f"the KeysManager of {name}")


@pytest.fixture(scope="module")
def servers(home_settings, partitioned, tmp_path_factory, module_redis_port):
    manifest = partitioned(MODEL, 4)
    root = tmp_path_factory.mktemp("multicast")
    bandwidth = max(s.bytes for s in manifest.stages) / SECONDS_PER_SHARD
    names = [f"vm-{i}" for i in range(4)]
    ports = {name: free_port() for name in names}
    settings = {}
    for name in names:
        home = root / name
        (home / "models").mkdir(parents=True)
        settings[name] = home_settings.replace(
            home=str(home), server=name, keysmanager_port=ports[name], redis_port=module_redis_port, internal_token=TOKEN,
            server_bandwidth=bandwidth, warm_runtime=False,  # no zygote importing torch beside the transfers
            # vm-0 holds the model; the others read its manifest from vm-0 as their model store.
            models=str(home_settings.models_dir if name == "vm-0" else home / "models"),
            models_url="" if name == "vm-0" else f"http://127.0.0.1:{ports['vm-0']}")
    clients = {name: KeysClient.for_settings(settings[name], timeout=60) for name in names}
    cluster = Servers(manifest, settings, clients, {})
    try:
        for name in names:
            cluster.launch(name)
        yield cluster
    finally:
        for proc in cluster.procs.values():
            proc.terminate()
            proc.wait(timeout=30)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_one_holder_sends_a_stage_to_three_servers_byte_for_byte_and_a_replica_follows_it(servers):
    info = servers.manifest.stages[1]
    targets = ["vm-1", "vm-2", "vm-3"]
    p = multicast.start(servers.clients, plan(["vm-0"], targets, 8), MODEL, info)
    # A replica starting on vm-2 now reads the shard as it arrives there, not from the store.
    target_settings = servers.settings["vm-2"]
    reader = start_readers(target_settings, StageRef(MODEL, 1, 2))[1]
    views = multicast.wait(servers.clients, targets, info.shard, 120)
    assert {t: v["state"] for t, v in views.items()} == dict.fromkeys(targets, "done"), views
    assert all(v["refetched"] == 0 and v["rerouted"] == 0 for v in views.values()), views
    for target in targets:
        assert sha256(servers.received(target, info.shard)) == info.sha256
    assert len(p.rounds) == 8 + 2 - 1
    reader.wait_done()
    assert reader.where.startswith("prefetch") and hashlib.sha256(reader.buffer).hexdigest() == info.sha256


def test_two_holders_send_in_two_subgroups_and_a_receiver_becomes_a_holder(servers):
    info = servers.manifest.stages[2]
    first = multicast.start(servers.clients, plan(["vm-0"], ["vm-1"], 4), MODEL, info)
    assert multicast.wait(servers.clients, ["vm-1"], info.shard, 60)["vm-1"]["state"] == "done"
    p = multicast.start(servers.clients, plan(["vm-0", "vm-1"], ["vm-2", "vm-3"], 4), MODEL, info)
    views = multicast.wait(servers.clients, ["vm-2", "vm-3"], info.shard, 120)
    assert {t: v["state"] for t, v in views.items()} == {"vm-2": "done", "vm-3": "done"}, views
    for target in ("vm-1", "vm-2", "vm-3"):
        assert sha256(servers.received(target, info.shard)) == info.sha256
    # vm-3 took every block from vm-1, which had only received the stage; vm-2 from vm-0.
    assert p.groups == (("vm-0", "vm-2"), ("vm-1", "vm-3")) and len(first.rounds) == 4
    assert {t.source for r in p.rounds for t in r if t.target == "vm-3"} == {"vm-1"}
    assert all(v["rerouted"] == 0 for v in views.values())


class CorruptingProxy(http.server.ThreadingHTTPServer):
    """Between the receivers and vm-0: passes every request on, and flips one byte of the
    first block it answers."""

    def __init__(self, upstream: str) -> None:
        self.upstream, self.corrupted = upstream, 0
        self.lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                request = urllib.request.Request(proxy.upstream + self.path,
                                                 headers={"Authorization": self.headers.get("Authorization", "")})
                try:
                    with urllib.request.urlopen(request, timeout=60) as reply:
                        status, body = reply.status, bytearray(reply.read())
                except urllib.error.HTTPError as exc:
                    status, body = exc.code, bytearray(exc.read())
                with proxy.lock:
                    if status == 200 and "/blocks/" in self.path and not proxy.corrupted:
                        body[len(body) // 2] ^= 0xFF
                        proxy.corrupted += 1
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(bytes(body))

            def log_message(self, *args) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)


def test_a_corrupted_block_is_detected_and_fetched_again(servers):
    info = servers.manifest.stages[3]
    proxy = CorruptingProxy(servers.clients["vm-0"].url)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        via_proxy = {**servers.clients, "vm-0": KeysClient(f"http://127.0.0.1:{proxy.server_port}")}
        multicast.start(via_proxy, plan(["vm-0"], ["vm-1"], 4), MODEL, info)
        view = multicast.wait(servers.clients, ["vm-1"], info.shard, 60)["vm-1"]
    finally:
        proxy.shutdown()
    assert proxy.corrupted == 1
    assert view["state"] == "done" and view["refetched"] == 1, view
    assert sha256(servers.received("vm-1", info.shard)) == info.sha256


def test_a_receiver_killed_mid_multicast_leaves_the_others_complete(servers):
    info = servers.manifest.stages[0]
    targets = ["vm-1", "vm-2", "vm-3"]
    multicast.start(servers.clients, plan(["vm-0"], targets, 16), MODEL, info)
    # vm-1 relays blocks to vm-3 in the plan: kill it once it holds some, before it holds all.
    wait_until(lambda: 0 < multicast.wait(servers.clients, ["vm-1"], info.shard, 0)["vm-1"].get("filled", 0),
               60, "vm-1 receiving")
    servers.procs["vm-1"].send_signal(signal.SIGKILL)
    servers.procs["vm-1"].wait(timeout=30)
    views = multicast.wait(servers.clients, targets, info.shard, 120)
    assert views["vm-1"]["state"] == "unreachable"
    assert views["vm-2"]["state"] == views["vm-3"]["state"] == "done", views
    assert views["vm-3"]["rerouted"] >= 1, views  # what vm-1 was to send it came from vm-0
    for target in ("vm-2", "vm-3"):
        assert sha256(servers.received(target, info.shard)) == info.sha256
    servers.launch("vm-1")  # for the tests after this one


def _get(servers: Servers, path: str, token: str | None = TOKEN) -> tuple[int, dict | None]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(servers.clients["vm-0"].url + path, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, None
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize("path,token,status", [
    ("/blocks/nosuch/stage-00.safetensors/0-1", TOKEN, 404),             # unknown model
    (f"/blocks/{MODEL}/stage-09.safetensors/0-1", TOKEN, 404),           # unknown shard
    (f"/blocks/{MODEL}/manifest.json/0-1", TOKEN, 404),                  # not a shard
    (f"/blocks/{MODEL}/stage-00.safetensors/5000-5001", TOKEN, 416),     # out of range
    (f"/blocks/{MODEL}/stage-00.safetensors/3-3", TOKEN, 416),           # empty
    (f"/blocks/{MODEL}/stage-00.safetensors/0-257", TOKEN, 413),         # over MAX_PULL_PIECES
    (f"/blocks/{MODEL}/stage-00.safetensors/0-x", TOKEN, 404),           # not a range
    (f"/blocks/{MODEL}/stage-00.safetensors/0-1?plan=xyz&round=1&after=0", TOKEN, 400),  # not a plan id
    (f"/blocks/{MODEL}/stage-00.safetensors/0-1?plan=ab&round=one", TOKEN, 400),       # not a round
    (f"/blocks/{MODEL}/stage-00.safetensors/0-1?plan=ab&round=1&after=1", TOKEN, 400),  # not before it
    (f"/blocks/{MODEL}/stage-00.safetensors/0-1", None, 401),            # no token
    (f"/blocks/{MODEL}/stage-00.safetensors/0-1", "wrong", 401),         # wrong token
])
def test_bad_block_requests_get_json_errors(servers, path, token, status):
    got, body = _get(servers, path, token)
    assert got == status and isinstance(body, dict) and body.get("error"), (got, body)


def test_a_block_is_the_shards_bytes(servers):
    info = servers.manifest.stages[0]
    request = urllib.request.Request(f"{servers.clients['vm-0'].url}/blocks/{MODEL}/{info.shard}/2-4",
                                     headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        data = reply.read()
    with open(servers.manifest.shard_path(0), "rb") as f:
        f.seek(2 * PIECE_BYTES)
        assert data == f.read(2 * PIECE_BYTES)


def test_a_server_sends_a_plans_blocks_in_its_rounds_order(servers):
    """A pull of round 1 that asks first still goes out after the same server's round 0: the
    link carries one block at a time in the plan's order (sent together, both would share it and
    round 1, started first, would end first). Round 1 asks again on a 429 (its turn had not come
    within the hold), as a receiver's pull does."""
    shard = servers.manifest.stages[0].shard
    ended: dict[int, float] = {}

    def pull(first: int, round_: int, after: int) -> None:
        query = f"plan=ab12&round={round_}&after={after}"
        request = urllib.request.Request(f"{servers.clients['vm-0'].url}/blocks/{MODEL}/{shard}/{first}-{first + 48}?{query}",
                                         headers={"Authorization": f"Bearer {TOKEN}"})
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(request, timeout=120) as reply:
                    assert len(reply.read()) == 48 * PIECE_BYTES
                break
            except urllib.error.HTTPError as exc:
                if exc.code != 429 or time.monotonic() > deadline:
                    raise
        ended[round_] = time.monotonic()

    later = threading.Thread(target=pull, args=(48, 1, 0))
    later.start()
    time.sleep(0.3)
    pull(0, 0, -1)
    later.join(timeout=120)
    assert ended[1] > ended[0], ended


def test_a_pull_of_pieces_still_on_their_way_is_held_until_they_land(servers):
    """A peer asking a receiver for a block it is still receiving gets the block once it is in,
    not a refusal to ask again (up to HOLD_S)."""
    info = servers.manifest.stages[2]
    servers.clients["vm-3"].cancel_receptions(MODEL)
    multicast.start(servers.clients, plan(["vm-0"], ["vm-3"], 8), MODEL, info)
    request = urllib.request.Request(f"{servers.clients['vm-3'].url}/blocks/{MODEL}/{info.shard}/0-2",
                                     headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        data = reply.read()
    with open(servers.manifest.shard_path(2), "rb") as f:
        assert data == f.read(2 * PIECE_BYTES)
    assert multicast.wait(servers.clients, ["vm-3"], info.shard, 60)["vm-3"]["state"] == "done"


@pytest.mark.parametrize("body,status", [
    ({"model": "nosuch", "shard": "stage-00.safetensors", "pulls": [{"source": "http://127.0.0.1:1", "first": 0,
                                                                     "end": 1}]}, 404),
    ({"model": MODEL, "shard": "stage-07.safetensors", "pulls": [{"source": "http://127.0.0.1:1", "first": 0,
                                                                  "end": 1}]}, 404),
    ({"model": MODEL, "shard": "stage-00.safetensors", "pulls": [{"source": "http://127.0.0.1:1", "first": 0,
                                                                  "end": 1}]}, 400),  # does not cover the shard
    ({"model": MODEL, "shard": "stage-00.safetensors", "pulls": [{"source": "file:///etc/passwd", "first": 0,
                                                                  "end": 1}]}, 400),
    ({"model": MODEL, "shard": "stage-00.safetensors", "pulls": []}, 400),
    ({"model": "../etc", "shard": "x", "pulls": []}, 400),
])
def test_bad_multicast_requests_get_json_errors_and_leave_nothing(servers, body, status):
    before = servers.clients["vm-2"].receptions()
    reply = servers.clients["vm-2"].request("POST", "/multicast", body)
    assert reply.status == status and reply.json().get("error"), (reply.status, reply.body[:200])
    assert servers.clients["vm-2"].receptions() == before
    assert not (Path(servers.settings["vm-2"].models_dir) / "nosuch").exists()
    assert not os.path.exists(servers.received("vm-2", "stage-07.safetensors"))


def test_a_binary_tree_plan_runs_too_and_cancelling_frees_what_arrived(servers):
    """The baseline the benchmark sets beside λScale's plan runs on the same machinery; and a
    model's receptions cancelled free their files."""
    info = servers.manifest.stages[1]
    for name in ("vm-1", "vm-2", "vm-3"):
        servers.clients[name].cancel_receptions(MODEL)
        assert not servers.received(name, info.shard).exists() and servers.clients[name].receptions() == []
    multicast.start(servers.clients, binary_tree_plan("vm-0", ["vm-1", "vm-2", "vm-3"], 4), MODEL, info)
    views = multicast.wait(servers.clients, ["vm-1", "vm-2", "vm-3"], info.shard, 120)
    assert {v["state"] for v in views.values()} == {"done"}, views
    assert sha256(servers.received("vm-3", info.shard)) == info.sha256  # vm-3 took it from vm-1


def test_a_unicast_plan_completes_though_the_last_target_waits_its_turn_for_longer_than_a_pull_is_held(servers):
    """One holder sends the stage to each target in turn: the last one's pulls wait two shards'
    time (about 8 s) for their turn, told to ask again every HOLD_S, and it still completes."""
    info = servers.manifest.stages[3]
    targets = ["vm-1", "vm-2", "vm-3"]
    for name in targets:
        servers.clients[name].cancel_receptions(MODEL)
    p = multicast.start(servers.clients, unicast_plan("vm-0", targets, 2), MODEL, info)
    views = multicast.wait(servers.clients, targets, info.shard, 120)
    assert {v["state"] for v in views.values()} == {"done"}, views
    assert views["vm-3"]["finished"] > views["vm-2"]["finished"] > views["vm-1"]["finished"]
    assert all(v["rerouted"] == 0 for v in views.values()) and len(p.rounds) == 6
    for name in targets:
        assert sha256(servers.received(name, info.shard)) == info.sha256


def test_a_servers_downlink_is_paced_too(servers):
    """What a server reads from its model store comes in no faster than its link: a prefetch
    (the store's own file route is not paced) takes at least the shard's bytes over the speed."""
    info = servers.manifest.stages[3]
    client = servers.clients["vm-2"]
    client.cancel_receptions(MODEL)  # the prefetch folder holds nothing of the model now
    started = time.monotonic()
    client.prefetch(StageRef(MODEL, 3, 4))
    wait_until(lambda: any(p["state"] != "fetching" for p in client.prefetches()), 120, "the prefetch")
    took = time.monotonic() - started
    assert [p["state"] for p in client.prefetches()] == ["done"]
    assert took >= 0.9 * info.bytes / servers.settings["vm-2"].servers.bandwidth, took
    assert sha256(servers.received("vm-2", info.shard)) == info.sha256
    client.cancel_prefetch(MODEL)


def test_a_shard_being_received_is_not_prefetched_as_well(servers):
    """A cold start placed where a multicast already brings the shard (a peer start whose plan
    failed for another target falls back to cold) prefetches nothing of it: the reception is the
    shard's one writer, and the replica follows it."""
    info = servers.manifest.stages[2]
    client = servers.clients["vm-3"]
    client.cancel_receptions(MODEL)
    client.cancel_prefetch(MODEL)
    multicast.start(servers.clients, plan(["vm-0"], ["vm-3"], 8), MODEL, info)
    client.prefetch(StageRef(MODEL, 2, 3))
    wait_until(lambda: any(p["state"] != "fetching" for p in client.prefetches()), 60, "the prefetch")
    assert [p["state"] for p in client.prefetches()] == ["done"]
    assert [r["state"] for r in client.receptions() if r["shard"] == info.shard] == ["receiving"]
    views = multicast.wait(servers.clients, ["vm-3"], info.shard, 120)
    assert views["vm-3"]["state"] == "done" and views["vm-3"]["refetched"] == 0, views
    assert sha256(servers.received("vm-3", info.shard)) == info.sha256
    client.cancel_prefetch(MODEL)
    client.cancel_receptions(MODEL)


def test_a_stage_of_several_shards_goes_as_one_model_each_subgroup_completing_its_part_first(servers):
    """λScale's Algorithm 1 across a stage's shards (`send_stage`): with two holders, vm-2 (in
    vm-0's sub-group) holds shard 0 whole before shard 1 and vm-3 (in vm-1's) shard 1 before
    shard 0, so that early on different servers hold different whole shards; both end with
    every shard, byte for byte."""
    stage, models = StageRef(MODEL, 0, 2), servers.settings["vm-0"].models_dir
    first, second = (servers.manifest.stages[i] for i in stage.indices())
    for name in ("vm-1", "vm-2", "vm-3"):
        servers.clients[name].cancel_receptions(MODEL)
    multicast.send_stage(servers.clients, stage, ["vm-0"], ["vm-1"], 4, models)
    for info in (first, second):
        assert multicast.wait(servers.clients, ["vm-1"], info.shard, 60)["vm-1"]["state"] == "done"
    p = multicast.send_stage(servers.clients, stage, ["vm-0", "vm-1"], ["vm-2", "vm-3"], 4, models)
    views = {info.shard: multicast.wait(servers.clients, ["vm-2", "vm-3"], info.shard, 120) for info in (first, second)}
    assert {v["state"] for by in views.values() for v in by.values()} == {"done"}, views
    assert p.groups == (("vm-0", "vm-2"), ("vm-1", "vm-3")) and p.blocks == 4
    assert views[first.shard]["vm-2"]["finished"] < views[second.shard]["vm-2"]["finished"]
    assert views[second.shard]["vm-3"]["finished"] < views[first.shard]["vm-3"]["finished"]
    for name in ("vm-2", "vm-3"):
        assert [sha256(servers.received(name, info.shard)) for info in (first, second)] == [first.sha256, second.sha256]
