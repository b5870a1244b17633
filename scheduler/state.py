"""What the placement policy sees and what it decides. Plain values, no I/O: the local provider,
the simulator, the benchmark and the tests build these and call the same `Scheduler`."""
from __future__ import annotations

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


@dataclass(frozen=True, slots=True)
class Replica:
    id: str
    stage: str                          # "model:stages"
    server: str
    started_by: str = "cold"            # "cold", "fork-cow", "fork-copy"
    ready: bool = True
    started_at: float = 0.0


@dataclass(frozen=True, slots=True)
class ClusterState:
    servers: tuple[Server, ...]
    replicas: tuple[Replica, ...] = ()
    key_stages: frozenset[str] = frozenset()
    now: float = 0.0


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
    path: str                           # "fork" (from the server's zygote) or "cold"
    reason: str


@dataclass(frozen=True, slots=True)
class Removal:
    replica: str
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
