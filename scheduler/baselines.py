"""Placements to compare the scheduler with: first-fit (the first server by name with a free
slot) and uniformly random among servers with a free slot. They start a replica by fork where
the chosen server happens to cache its stage, and ignore dispersion and cold-start contention."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter

import numpy as np

from scheduler.state import Change, ClusterState, Placement, Schedule


class _Baseline(ABC):
    name = ""

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)

    @abstractmethod
    def _choose(self, open_servers: list[str]) -> str:
        """The server for the next replica, among those with a free slot (sorted by name)."""

    def schedule(self, state: ClusterState, changes: list[Change]) -> Schedule:
        used = Counter(r.server for r in state.replicas)
        free = {s.name: s.slots - used[s.name] for s in sorted(state.servers, key=lambda s: s.name)}
        cached = {s.name: s.cached for s in state.servers}
        placements, unplaced = [], []
        for change in (c for c in changes if c.count > 0):
            for _ in range(change.count):
                open_servers = [n for n, f in free.items() if f > 0]
                if not open_servers:
                    unplaced.append((change.stage, "no server has a free slot"))
                    continue
                name = self._choose(open_servers)
                free[name] -= 1
                path = "fork" if change.stage in cached[name] else "cold"
                placements.append(Placement(change.stage, name, path, self.name))
        return Schedule(tuple(placements), (), tuple(unplaced))


class FirstFit(_Baseline):
    name = "first-fit"

    def _choose(self, open_servers: list[str]) -> str:
        return open_servers[0]


class RandomFit(_Baseline):
    name = "random"

    def _choose(self, open_servers: list[str]) -> str:
        return open_servers[int(self.rng.integers(len(open_servers)))]
