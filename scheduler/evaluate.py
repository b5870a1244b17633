"""How good a placement is: key-stage dispersion, room for key stages to grow, and how many
scale-ups start by fork. Used by the tests, the benchmark and the simulator."""
from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, replace

from scheduler.state import ClusterState, PlacedReplica, ReplicaId, Schedule


def apply(state: ClusterState, schedule: Schedule) -> ClusterState:
    """The cluster after a schedule: its placements added, its removals gone."""
    gone = {r.replica for r in schedule.removals}
    kept = tuple(r for r in state.replicas if r.id not in gone)
    added = tuple(PlacedReplica(ReplicaId(p.server, name=f"new-{n}"), p.stage, p.server,
                                "fork-cow" if p.path == "fork" else "cold", ready=False, started_at=state.now)
                  for n, p in enumerate(schedule.placements))
    return replace(state, replicas=kept + added)


@dataclass(frozen=True)
class Dispersion:
    max_share: float       # mean over key stages of the largest share of its replicas on one server
    entropy: float         # mean over key stages of the entropy of its replicas over servers, nats
    headroom: float        # mean over key stages of free slots on the servers that host it
    fork_share: float      # placements that start by fork / all placements

    def as_dict(self) -> dict[str, float]:
        return {"max_share": self.max_share, "entropy": self.entropy, "headroom": self.headroom,
                "fork_share": self.fork_share}


def dispersion(state: ClusterState, schedule: Schedule | None = None) -> Dispersion:
    used = Counter(r.server for r in state.replicas)
    free = {s.name: max(0, s.slots - used[s.name]) for s in state.servers}
    where: dict[str, Counter] = defaultdict(Counter)
    for r in state.replicas:
        if r.stage in state.key_stages:
            where[r.stage][r.server] += 1
    shares, entropies, rooms = [], [], []
    for counts in where.values():
        total = sum(counts.values())
        p = [n / total for n in counts.values()]
        shares.append(max(p))
        entropies.append(-sum(x * math.log(x) for x in p if x > 0))
        rooms.append(sum(free[s] for s in counts))
    forks = [p.path == "fork" for p in schedule.placements] if schedule else []
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    return Dispersion(mean(shares), mean(entropies), mean(rooms), mean(forks))
