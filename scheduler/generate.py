"""Random cluster states for the benchmark, the tests and the simulator: servers with slots,
pipelines whose replicas occupy part of them, caches on some servers, and a burst to place."""
from __future__ import annotations

import numpy as np

from scheduler.state import Change, ClusterState, PlacedReplica, ReplicaId, Server


def cluster(servers: int, slots: int = 4, models: int = 5, stages: int = 8, occupancy: float = 0.4,
            cache_share: float = 0.3, seed: int = 0, bandwidth: float = 2e9) -> ClusterState:
    """`occupancy` of all slots hold replicas of random stages; each server caches each stage
    with probability `cache_share`; the key stage of every model is stage 3 (its heaviest)."""
    rng = np.random.default_rng(seed)
    names = [f"server-{j:04d}" for j in range(servers)]
    all_stages = [f"model{m}:{s}" for m in range(models) for s in range(stages)]
    used = np.zeros(servers, dtype=int)
    replicas = []
    for n in range(int(occupancy * servers * slots)):
        j = int(rng.choice(np.flatnonzero(used < slots)))
        used[j] += 1
        replicas.append(PlacedReplica(ReplicaId(names[j], n), all_stages[int(rng.integers(len(all_stages)))], names[j],
                                      started_by="cold", started_at=float(n)))
    caches = [frozenset(s for s in all_stages if rng.random() < cache_share) for _ in names]
    return ClusterState(tuple(Server(n, slots, bandwidth, c) for n, c in zip(names, caches)),
                        tuple(replicas), frozenset(f"model{m}:3" for m in range(models)), now=0.0)


def burst(state: ClusterState, instances: int, key_share: float = 0.7, shard_bytes: float = 2e9,
          deadline_s: float = 60.0, seed: int = 0) -> list[Change]:
    """`instances` replicas to add, `key_share` of them to key stages, the rest to other stages."""
    rng = np.random.default_rng(seed)
    key = sorted(state.key_stages)
    others = sorted({r.stage for r in state.replicas} - state.key_stages) or key
    counts: dict[str, int] = {}
    for _ in range(instances):
        pool = key if rng.random() < key_share else others
        stage = pool[int(rng.integers(len(pool)))]
        counts[stage] = counts.get(stage, 0) + 1
    return [Change(s, n, shard_bytes, deadline_s) for s, n in sorted(counts.items())]
