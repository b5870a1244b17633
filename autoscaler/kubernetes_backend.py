"""The autoscaler's backend on a real OpenFaaS on Kubernetes (QUART_BACKEND=kubernetes).

A stage function's replicas are its OpenFaaS Deployment's pods plus the replicas that the
KeysManagers (one pod per node, deploy/kubernetes/keysmanager.yml) forked for it. A change of
replicas goes through the same scheduler as on one machine (scheduler/placement.py), over the
cluster's real nodes, and takes effect this way:

- a placement by fork: the chosen node's KeysManager forks the replica (it lives in that pod, so
  on exactly that node, and joins the stage's consumer group like any replica);
- a cold placement: one more replica through the gateway's scale API (pods not ready yet count
  as cold starts under way on their node, for the scheduler's deadline rule). OpenFaaS owns its
  Deployments and Community Edition lets nobody else place their pods, so kube-scheduler picks
  the node; the dispersion of key stages (QUART §6.2) is carried by the forks, which go where the
  scheduler says. CE also clamps a function to 5 replicas; forks are outside that count.
- a removal: a forked replica is drained by its KeysManager; a pod gets the lowest
  pod-deletion-cost, so that the ReplicaSet removes that pod when the gateway scales down.

CPUs change in place through each pod's resize subresource (Kubernetes 1.33 and later, no
restart), and through the Redis key forked replicas read between work items.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass

from autoscaler.backends import GatewayFunctions
from contracts.config import REPLICAS_PER_CORE, Settings
from contracts.http_client import GatewayClient
from contracts.stack import Pipeline
from contracts.stage import StageRef
from keysmanager.client import KeysClient, KeysManagerError
from models.fetch import FetchError, ensure_model
from models.sizes import stage_bytes
from scheduler.coldstart import ColdServer
from scheduler.placement import Scheduler, SchedulerParams
from scheduler.state import Change, ClusterState, PlacedReplica, ReplicaId, Schedule, ServerView, cluster_state, fetches_under_way
from state.records import Placement
from state.store import Store

log = logging.getLogger("quart.kubernetes")
KEYSMANAGER_SELECTOR = "app.kubernetes.io/name=quart-keysmanager"
FUNCTION_LABEL = "faas_function"          # faas-netes labels every function pod with it
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
STRATEGIC_MERGE = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"


@dataclass(frozen=True)
class Pod:
    name: str
    function: str
    node: str
    ready: bool
    started: float
    terminating: bool = False       # deleted, still running: it holds its node's slot until it is gone


@dataclass(frozen=True)
class Fork:
    pid: int
    function: str
    node: str
    since: float

    @property
    def id(self) -> ReplicaId:
        return ReplicaId(self.node, self.pid)


@dataclass
class View:
    """One look at the cluster: nodes with their slots, the KeysManager of each node, the
    function pods, the forked replicas and the gateway's replica counts."""
    nodes: dict[str, int]
    keysmanagers: dict[str, str]          # node -> the KeysManager pod's address
    pods: list[Pod]
    forks: list[Fork]
    gateway: dict[str, int]


class KubernetesBackend(GatewayFunctions):
    """A model's whole-model function (GatewayFunctions) is scaled through the gateway: its pods
    are cold starts that kube-scheduler places."""
    def __init__(self, settings: Settings, gateway: GatewayClient, core, pipelines: dict[str, Pipeline],
                 store: Store, scheduler: Scheduler | None = None) -> None:
        """`core`: a kubernetes.client.CoreV1Api."""
        self.settings = settings
        self.gateway = self.client = gateway
        self.core = core
        self.pipelines = pipelines
        self.store = store
        self.namespace = settings.gateway.namespace
        self.scheduler = scheduler or Scheduler(SchedulerParams.from_settings(settings))
        self.stage_of = {fn: stage for p in pipelines.values() for stage, fn in zip(p.stages, p.functions)}
        self._bytes: dict[str, float] = {}

    # -- Backend ---------------------------------------------------------------------------------

    def desired_replicas(self) -> dict[str, list[int]]:
        view = self.view()
        forks = Counter(f.function for f in view.forks)
        return {m: [view.gateway.get(fn, 0) + forks[fn] for fn in p.functions] for m, p in self.pipelines.items()}

    def set_replicas(self, stage: StageRef, replicas: int) -> None:
        function = self.pipelines[stage.model].function(stage)
        view = self.view()
        state = self.state(view)
        current = sum(1 for r in state.replicas if r.stage == stage.key)
        if replicas == current:
            return
        change = Change(stage.key, replicas - current, self.shard_bytes(stage), self.settings.servers.cold_deadline_s)
        schedule = self.scheduler.schedule(state, [change])
        self.apply(function, schedule, view)

    def set_cpus(self, stage: StageRef, cpus: int) -> None:
        function = self.pipelines[stage.model].function(stage)
        self.store.set_stage_cpus(stage, cpus)  # the forked replicas apply it themselves
        body = {"spec": {"containers": [{"name": function, "resources": {"requests": {"cpu": str(cpus)},
                                                                         "limits": {"cpu": str(cpus)}}}]}}
        for pod in (p for p in self.pods(function) if not p.terminating):
            self.core.patch_namespaced_pod_resize(pod.name, self.namespace, body, _content_type=STRATEGIC_MERGE)

    # -- what the cluster holds ------------------------------------------------------------------

    def view(self) -> View:
        nodes = {n.metadata.name: self._slots(n) for n in self.core.list_node().items if _schedulable(n)}
        keysmanagers = {p.spec.node_name: p.status.pod_ip for p in self.core.list_namespaced_pod(
            self.namespace, label_selector=KEYSMANAGER_SELECTOR).items if _running(p) and p.status.pod_ip}
        forks = []
        for node, address in keysmanagers.items():
            try:
                listed = KeysClient.at(address, self.settings, timeout=10).forks()
            except (KeysManagerError, OSError) as exc:
                log.warning("the KeysManager on %s did not list its forks: %s", node, exc)
                continue
            forks += [Fork(f["pid"], f["function"], node, f["since"]) for f in listed if f["function"] in self.stage_of]
        gateway = {f["name"]: int(f.get("replicas", 0)) for f in self.gateway.functions()}
        return View(nodes, keysmanagers, self.pods(), forks, gateway)

    def pods(self, function: str | None = None) -> list[Pod]:
        selector = f"{FUNCTION_LABEL}={function}" if function else FUNCTION_LABEL
        out = []
        for p in self.core.list_namespaced_pod(self.namespace, label_selector=selector).items:
            fn = (p.metadata.labels or {}).get(FUNCTION_LABEL, "")
            if fn in self.stage_of and p.status.phase in ("Pending", "Running"):
                started = p.status.start_time.timestamp() if p.status.start_time else time.time()
                out.append(Pod(p.metadata.name, fn, p.spec.node_name or "", _running(p), started,
                               p.metadata.deletion_timestamp is not None))
        return out

    def state(self, view: View) -> ClusterState:
        """The scheduler's picture: nodes (slots, cached stages), every stage replica, key stages."""
        servers, now = [], time.time()
        for node, slots in sorted(view.nodes.items()):
            cached, held = self.store.cached_stages(node) if node in view.keysmanagers else (frozenset(), 0)
            starting = [(self.shard_bytes(self.stage_of[p.function]), p.started) for p in view.pods
                        if p.node == node and not p.ready and not p.terminating]
            fetches = fetches_under_way(starting, self.settings.servers.bandwidth, self.settings.servers.cold_deadline_s,
                                        now)
            servers.append(ServerView(node, slots, self.settings.servers.bandwidth, cached, held, fetches))
        replicas = [(PlacedReplica(ReplicaId(p.node, name=p.name), self.stage_of[p.function].key, p.node, "cold", p.ready, p.started),
                     p.terminating) for p in view.pods if p.node]
        replicas += [(PlacedReplica(f.id, self.stage_of[f.function].key, f.node, "fork-cow", True, f.since), False)
                     for f in view.forks]
        return cluster_state(servers, replicas, (s.key for s in self.store.key_stages()), now,
                             self.settings.servers.cache_bytes)

    def cold_servers(self, load_rate: float) -> list[ColdServer]:
        """Each schedulable node as a cold start sees it: its link (QUART_SERVER_BANDWIDTH), and a
        free slot or not, for the layout a sleeping model wakes in."""
        view = self.view()
        used = Counter(r.server for r in self.state(view).replicas)
        return [ColdServer(node, self.settings.servers.bandwidth, load_rate, fits_full=used[node] < slots)
                for node, slots in sorted(view.nodes.items())]

    def shard_bytes(self, stage: StageRef) -> float:
        """Bytes a cold start of the stage reads (from the manifest, fetched once if need be)."""
        if stage.key not in self._bytes:
            try:
                ensure_model(self.settings, stage.model)
                self._bytes[stage.key] = stage_bytes(self.settings.models_dir, stage.model, stage.first, stage.last)
            except (FileNotFoundError, FetchError) as exc:
                log.warning("size of %s unknown (%s): cold starts are placed as if instant", stage, exc)
                return 0.0
        return self._bytes[stage.key]

    # -- putting a schedule into effect ----------------------------------------------------------

    def apply(self, function: str, schedule: Schedule, view: View) -> None:
        stage = self.stage_of[function]
        cold = 0
        for p in schedule.placements:
            if p.path == "fork":
                KeysClient.at(view.keysmanagers[p.server], self.settings).fork(stage, function)
            else:
                cold += 1
            self._record("add", p.stage, p.server, p.path, p.reason)
        leaving = []
        for removal in schedule.removals:
            replica = removal.replica
            if replica.name:  # a pod
                leaving.append(replica.name)
            else:
                KeysClient.at(view.keysmanagers[replica.server], self.settings).stop(replica.pid)
            self._record("remove", removal.stage, removal.server, "pod" if replica.name else "fork", removal.reason)
        for pod in leaving:  # the ReplicaSet removes the pods of lowest deletion cost first
            self.core.patch_namespaced_pod(pod, self.namespace, {"metadata": {"annotations": {DELETION_COST: "-1000"}}},
                                           _content_type=MERGE)
        for stage_key, why in schedule.unplaced:
            self._record("unplaced", stage_key, "", "", why)
        if cold or leaving:
            wanted = view.gateway.get(function, 0) + cold - len(leaving)
            reply = self.gateway.scale(function, wanted)
            if reply.status not in (200, 202):
                raise RuntimeError(f"scaling {function} to {wanted}: {reply.status} {reply.body[:200]!r}")

    def _record(self, op: str, stage: str, server: str, path: str, reason: str) -> None:
        record = Placement(op, stage, reason, server, path, t=time.time())
        log.info("%s", record)
        self.store.add_placement(record, self.settings.data.records_maxlen)

    def _slots(self, node) -> int:
        return max(1, REPLICAS_PER_CORE * _cores(node.status.allocatable.get("cpu", "1")) // self.settings.compute.threads)


def _cores(quantity: str) -> int:
    """Whole cores of a Kubernetes CPU quantity ("4", "3500m")."""
    return int(float(quantity[:-1]) / 1000) if quantity.endswith("m") else int(float(quantity))


def _schedulable(node) -> bool:
    ready = any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])
    return ready and not node.spec.unschedulable


def _running(pod) -> bool:
    return pod.status.phase == "Running" and any(c.type == "Ready" and c.status == "True"
                                                 for c in pod.status.conditions or [])
