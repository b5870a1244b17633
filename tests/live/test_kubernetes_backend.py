"""The autoscaler's Kubernetes backend against a recorded two-node scenario: node km-test runs a
KeysManager (a real one here, forking real replicas, with a real redis-server), node-b has none
yet. The Kubernetes API server and the OpenFaaS gateway cannot run here: they are faked on
loopback (tests/fake_cluster.py), and every request the backend sends them is checked against
the real APIs' descriptions. No live cluster ran these decisions."""
from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import kubernetes
import pytest
from kubernetes_validate import ValidationError

from autoscaler.kubernetes_backend import DELETION_COST, KubernetesBackend
from autoscaler.loop import ControlLoop
from contracts.http_client import GatewayClient
from contracts.stack import pipelines, read_stack
from contracts.stage import StageRef
from state import keys
from state.store import RedisStore
from tests.fake_cluster import FakeGateway, FakeKubernetes, Request, Served, node, pod
from tests.kustomize import objects
from tests.live.runtime_helpers import wait_until

REPO = Path(__file__).resolve().parents[2]
NS = "openfaas-fn"
S1, S2 = StageRef.parse("smollm2", "1"), StageRef.parse("smollm2", "2")


def scenario() -> FakeKubernetes:
    fn = {f"smollm2-s{i}": "km-test" if i in (0, 3) else "node-b" for i in range(4)}
    pods = [pod(f"{name}-7d9f-{i}", where, {"faas_function": name}, NS) for i, (name, where) in enumerate(fn.items())]
    pods.append(pod("smollm2-5c8b-x", "node-b", {"faas_function": "smollm2"}, NS))  # the entry: not a stage
    pods.append(pod("quart-keysmanager-abcde", "km-test", {"app.kubernetes.io/name": "quart-keysmanager"}, NS,
                    ip="127.0.0.1"))
    return FakeKubernetes([node("km-test", "2"), node("node-b", "4")], pods)


@pytest.fixture
def cluster(km):
    settings, client, r, children = km
    fake, gateway = scenario(), FakeGateway({f"smollm2-s{i}": 1 for i in range(4)} | {"smollm2": 1})
    fake.validate_scenario()
    k8s, gw = Served(fake.handle), Served(gateway.handle)
    config = kubernetes.client.Configuration(host=k8s.url)
    core = kubernetes.client.CoreV1Api(kubernetes.client.ApiClient(config))
    backend = KubernetesBackend(settings.replace(namespace=NS), GatewayClient(gw.url, "admin", "secret"), core,
                                pipelines(read_stack(REPO / "stack.yml")), RedisStore(r))
    RedisStore(r).publish_key_stages("smollm2", ())
    try:
        yield backend, fake, gateway, client
    finally:
        for f in client.forks():
            client.stop(f["pid"])
        k8s.close()
        gw.close()
    fake.check()


def test_replicas_are_pods_plus_forks(cluster) -> None:
    backend, fake, gateway, _ = cluster
    assert backend.desired_replicas()["smollm2"] == [1, 1, 1, 1]
    assert {(r.method, r.path) for r in fake.requests} == {("GET", "/api/v1/nodes"),
                                                          ("GET", f"/api/v1/namespaces/{NS}/pods")}


def test_a_cached_key_stage_grows_by_a_fork_on_its_node(cluster, km) -> None:
    backend, fake, gateway, keysmanager = cluster
    _, _, r, _ = km
    keysmanager.cache(S1)
    RedisStore(r).publish_key_stages("smollm2", (S1,))
    backend.set_replicas(S1, 2)
    forks = keysmanager.forks()
    assert [(f["function"], f["stages"]) for f in forks] == [("smollm2-s1", "1")]
    assert not [q for q in gateway.requests if q[0] == "POST"]     # no pod added
    assert backend.desired_replicas()["smollm2"][1] == 2
    # Shrinking removes the fork first (its KeysManager drains it), and leaves the pod alone.
    backend.set_replicas(S1, 1)
    wait_until(lambda: not keysmanager.forks(), 60, "the fork to be drained")
    assert not [q for q in fake.requests if q.method == "PATCH"]


def test_an_uncached_stage_grows_cold_through_the_gateway(cluster) -> None:
    backend, fake, gateway, _ = cluster
    backend.set_replicas(S2, 3)
    assert [q for q in gateway.requests if q[0] == "POST"] == \
        [("POST", "/system/scale-function/smollm2-s2", {"serviceName": "smollm2-s2", "namespace": NS, "replicas": 3})]


def test_a_pod_leaves_by_its_deletion_cost_then_the_gateway_scales_down(cluster) -> None:
    backend, fake, gateway, _ = cluster
    backend.set_replicas(S2, 0)
    patches = [q for q in fake.requests if q.method == "PATCH"]
    assert [(q.path, q.body) for q in patches] == \
        [(f"/api/v1/namespaces/{NS}/pods/smollm2-s2-7d9f-2", {"metadata": {"annotations": {DELETION_COST: "-1000"}}})]
    assert gateway.requests[-1] == ("POST", "/system/scale-function/smollm2-s2",
                                    {"serviceName": "smollm2-s2", "namespace": NS, "replicas": 0})


def test_cpus_change_in_place_through_the_resize_subresource(cluster, km) -> None:
    backend, fake, _, _ = cluster
    _, _, r, _ = km
    backend.set_cpus(S1, 2)
    resize = [q for q in fake.requests if q.method == "PATCH"]
    assert [(q.path, q.content_type) for q in resize] == \
        [(f"/api/v1/namespaces/{NS}/pods/smollm2-s1-7d9f-1/resize", "application/strategic-merge-patch+json")]
    container = resize[0].body["spec"]["containers"][0]
    assert container == {"name": "smollm2-s1", "resources": {"requests": {"cpu": "2"}, "limits": {"cpu": "2"}}}
    assert r.get(keys.stage_cpus(S1)) == b"2"  # what the forked replicas read


def test_pods_not_ready_yet_are_cold_starts_under_way_on_their_node(cluster) -> None:
    backend, fake, _, _ = cluster
    backend.settings = backend.settings.replace(server_bandwidth=1e6)  # a cold start then reads for minutes
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    fake.pods.append(pod("smollm2-s2-7d9f-9", "node-b", {"faas_function": "smollm2-s2"}, NS, ready=False, started=now))
    servers = {s.name: s for s in backend.state(backend.view()).servers}
    assert servers["km-test"].fetches == ()
    (fetch,) = servers["node-b"].fetches
    assert 0 < fetch.pending_bytes <= backend.shard_bytes(S2)


def test_a_sleeping_model_may_wake_on_the_nodes_with_a_free_slot(cluster) -> None:
    backend, _, _, _ = cluster
    backend.settings = backend.settings.replace(threads=8, server_bandwidth=1e8)  # km-test: 2 slots, both taken
    servers = backend.cold_servers(load_rate=2e9)
    assert [(s.name, s.bandwidth, s.load_rate, s.fits_full) for s in servers] == \
        [("km-test", 1e8, 2e9, False), ("node-b", 1e8, 2e9, True)]
    # The autoscaler's choice over them: four stage functions need four free nodes, so the model wakes whole.
    loop = ControlLoop(backend.settings, backend, backend.store, backend.pipelines)
    choice = loop._wake_choice(backend.pipelines["smollm2"])
    assert choice.whole and choice.plan.servers == ("node-b",) and "the only layout with room" in choice.reason


def test_the_checks_refuse_what_the_api_would() -> None:
    fake = FakeKubernetes([], [])
    resize = f"/api/v1/namespaces/{NS}/pods/p/resize"
    body = {"spec": {"containers": [{"name": "c", "resources": {"limits": {"cpu": "2"}}}]}}
    for wrong in (Request("POST", resize, {}, "application/json", body),                    # no such operation
                  Request("PATCH", resize, {}, "application/json-patch+json", body),        # the client's default
                  Request("PATCH", resize, {}, "application/strategic-merge-patch+json",
                          {"spec": {"containers": [{"name": "c", "resources": {"limit": {}}}]}})):  # a typo
        fake.requests = [wrong]
        with pytest.raises((AssertionError, ValidationError)):
            fake.check()


def granted() -> set[tuple[str, str]]:
    """(verb, resource) the autoscaler's Role and ClusterRole in deploy/kubernetes/rbac.yml allow."""
    rules = [rule for d in objects() if d["kind"] in ("Role", "ClusterRole") and d["metadata"]["name"].startswith(
        "quart-autoscaler") for rule in d["rules"]]
    return {(verb, resource) for rule in rules for verb in rule["verbs"] for resource in rule["resources"]}


def used(request: Request) -> tuple[str, str]:
    parts = request.path.strip("/").split("/")        # api v1 [namespaces ns] resource [name [subresource]]
    rest = parts[4:] if parts[2] == "namespaces" else parts[2:]
    verb = {"GET": "list" if len(rest) == 1 else "get", "PATCH": "patch"}[request.method]
    return verb, "/".join([rest[0], *rest[2:3]])


def test_rbac_grants_exactly_what_the_backend_uses(cluster) -> None:
    backend, fake, _, _ = cluster
    backend.desired_replicas()
    backend.set_replicas(S2, 0)
    backend.set_cpus(S1, 2)
    assert {used(r) for r in fake.requests} == granted()
