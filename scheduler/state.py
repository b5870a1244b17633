"""What the placement policy sees and what it decides. Plain values, no I/O: the local provider,
the simulator, the benchmark and the tests build these and call the same `Scheduler`."""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Fetch:
    """A cold start under way on a server: bytes it still has to read and when it must be done."""
    pending_bytes: float
    deadline: float


def fetches_under_way(starts: list[tuple[float, float]], bandwidth: float, deadline_s: float,
                      now: float, deadlines: list[float] | None = None) -> tuple[Fetch, ...]:
    """The cold starts under way on one server, from each one's (shard bytes, start time): each
    assumed to have read its equal share of the server's bandwidth since it started. Each has
    `deadline_s` from its start to finish, or its own in `deadlines`."""
    share = bandwidth / max(1, len(starts))
    deadlines = deadlines or [deadline_s] * len(starts)
    return tuple(Fetch(max(0.0, size - share * (now - started)), started + d)
                 for (size, started), d in zip(starts, deadlines))


@dataclass(frozen=True, slots=True)
class Server:
    name: str
    slots: int                          # replicas it can host (GPUs, or CPU slots)
    bandwidth: float = 1e9              # bytes/s for cold starts (network or disk)
    cached: frozenset[str] = frozenset()  # stage keys its KeysManager holds ("model:stages")
    memory_pressure: bool = False       # its host memory is over the KeysManager's threshold
    fetches: tuple[Fetch, ...] = ()


@dataclass(frozen=True, order=True, slots=True)
class ReplicaId:
    """A replica as the scheduler names it, whatever runs it: a process on a server (the embedded
    runtime's, the simulator's, or one a node's KeysManager forked), by `pid`; or by `name` (a
    pod, or a replica a schedule only plans)."""
    server: str
    pid: int = 0
    name: str = ""

    def __str__(self) -> str:
        return self.name or f"{self.server}/{self.pid}"


@dataclass(frozen=True, slots=True)
class PlacedReplica:
    """A stage replica where the scheduler sees it: on which server, how it started, whether it serves."""
    id: ReplicaId
    stage: str                          # "model:stages"
    server: str
    started_by: str = "cold"            # "cold", "fork-cow", "fork-copy"
    ready: bool = True
    started_at: float = 0.0


@dataclass(frozen=True, slots=True)
class ClusterState:
    servers: tuple[Server, ...]
    replicas: tuple[PlacedReplica, ...] = ()
    key_stages: frozenset[str] = frozenset()
    now: float = 0.0
    store_bandwidth: float = 0.0        # bytes/s of the model store's link; 0: servers read their own disks


@dataclass(frozen=True, slots=True)
class ServerView:
    """A server as its backend sees it (the embedded runtime's, Kubernetes' nodes, the simulator's),
    before the rules that `cluster_state` applies to every backend alike."""
    name: str
    slots: int
    bandwidth: float
    cached: frozenset[str] = frozenset()
    cached_bytes: int = 0
    fetches: tuple[Fetch, ...] = ()


def cluster_state(servers: Iterable[ServerView], replicas: Iterable[tuple[PlacedReplica, bool]], key_stages: Iterable[str],
                  now: float, cache_budget: int = 0, store_bandwidth: float = 0.0) -> ClusterState:
    """The scheduler's picture, by one set of rules for every backend. `replicas`: each with
    whether it drains. A draining replica still holds its slot until it is gone, but is no longer
    the scheduler's to count or remove; a server whose KeysManager holds its cache budget is under
    memory pressure (its cold replicas are removed first)."""
    replicas = list(replicas)
    leaving = Counter(r.server for r, draining in replicas if draining)
    return ClusterState(
        tuple(Server(s.name, max(0, s.slots - leaving[s.name]), s.bandwidth, s.cached,
                     cache_budget > 0 and s.cached_bytes >= cache_budget, s.fetches) for s in servers),
        tuple(r for r, draining in replicas if not draining), frozenset(key_stages), now, store_bandwidth)


@dataclass(frozen=True, slots=True)
class Change:
    """Replicas to add (count > 0) or remove (count < 0) for one stage. A cold start reads
    `shard_bytes` and must finish by now + `deadline_s`."""
    stage: str
    count: int
    shard_bytes: float = 0.0
    deadline_s: float = 60.0


@dataclass(frozen=True, slots=True)
class Placement:
    stage: str
    server: str
    path: str                           # "fork" (from the server's zygote), "cold" (from the store) or "peer"
    reason: str
    predicted_s: float = 0.0            # cold and peer: until the shards are there (scheduler/peer_start.py)
    sources: tuple[str, ...] = ()       # peer: the servers that send them


@dataclass(frozen=True, slots=True)
class Removal:
    replica: ReplicaId
    stage: str
    server: str
    reason: str


@dataclass(frozen=True)
class Schedule:
    placements: tuple[Placement, ...] = ()
    removals: tuple[Removal, ...] = ()
    unplaced: tuple[tuple[str, str], ...] = ()   # (stage, why) for adds that found no server
    contention: str = "light"                     # "light" or "heavy"
    kl_trace: tuple[float, ...] = field(default=())  # the objective at every descent step
