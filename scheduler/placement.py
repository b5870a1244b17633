"""The cache-aware placement policy (QUART §6): where each new replica goes, how it starts, and
which replicas go when a stage shrinks. Pure: `Scheduler.schedule(state, changes)` reads plain
values and returns a `Schedule`.

- Light contention: a key stage's replica goes where that stage has the fewest replicas, a
  server that caches it counting as `cache_weight` replicas fewer (a fork instead of a cold start
  is worth that much dispersion), then to the server with the most free slots. Other stages are
  packed best-fit, away from servers that host key stages, so those keep room to grow into.
- Heavy contention (the adds take more than `heavy_above` of the free slots): the light
  placement of the key-stage replicas is the start P and descends towards the dispersed target
  Q (scheduler/kl.py), then is rounded to whole replicas within every server's free slots.
- A cold start (the server has no zygote of the stage) is admitted only where HydraServe's
  deadline rule holds (scheduler/fetch.py); where servers read a shared model store, the round's
  cold starts of a stage become one multicast from the servers that cache it when that is
  predicted sooner (λScale §5, scheduler/peer_start.py).
- Shrinking removes starting replicas first, then from the servers where the stage is most
  crowded, cold replicas before forked ones on servers under memory pressure, newest first."""
from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from contracts.config import Settings, from_params
from scheduler.fetch import admits
from scheduler.kl import descend, round_counts
from scheduler.peer_start import choose_sources
from scheduler.state import Change, ClusterState, Fetch, PlacedReplica, Placement, Removal, Schedule


@dataclass(frozen=True)
class SchedulerParams:
    cache_weight: float = 1.0     # replicas of dispersion a fork is worth
    heavy_above: float = 0.5      # adds / free slots above which contention is heavy
    kl_rate: float = 0.5
    kl_threshold: float = 0.02    # mean divergence per instance at which descent stops
    kl_max_iters: int = 40
    disperse: bool = True         # false: key stages' replicas are packed like the rest (ablation)
    peer_blocks: int = 8          # blocks of a peer start's multicast (the elbow of `benchmarks multicast`)
    peers: bool = True            # false: starts that cannot fork read the store (ablation)

    def __post_init__(self) -> None:
        if self.peer_blocks < 1:
            raise ValueError(f"peer_blocks: a stage is sent in at least one block, not {self.peer_blocks}")

    @classmethod
    def of(cls, params: dict) -> SchedulerParams:
        """From QUART_SCHEDULER_PARAMS; ConfigError naming a wrong field."""
        return from_params(cls, params, "QUART_SCHEDULER_PARAMS")

    @classmethod
    def from_settings(cls, settings: Settings) -> SchedulerParams:
        """QUART_SCHEDULER_PARAMS, with dispersion and peer starts off where QUART_ABLATE says so."""
        off = {name: False for name, mechanism in (("disperse", "dispersion"), ("peers", "peer-start"))
               if settings.autoscaler.ablated(mechanism)}
        return cls.of({**settings.servers.scheduler_params, **off})


@dataclass
class _Cluster:
    """Mutable working copy of the state while one schedule is built."""
    names: list[str]
    free: np.ndarray
    bandwidth: np.ndarray
    cached: list[frozenset[str]]
    fetches: list[tuple[Fetch, ...]]
    key_stages: frozenset[str]
    now: float
    same: dict[str, np.ndarray] = field(default_factory=dict)
    hosts_key: np.ndarray | None = None
    # Whether a cold start of (bytes, deadline) passes the deadline rule, per server; a
    # placement changes one server's fetches, so only that entry is recomputed.
    cold_ok: dict[tuple[float, float], np.ndarray] = field(default_factory=dict)
    _cached_masks: dict[str, np.ndarray] = field(default_factory=dict)

    @classmethod
    def of(cls, state: ClusterState) -> _Cluster:
        servers = sorted(state.servers, key=lambda s: s.name)
        names = [s.name for s in servers]
        index = {n: j for j, n in enumerate(names)}
        used = Counter(r.server for r in state.replicas)
        c = cls(names, np.array([max(0, s.slots - used[s.name]) for s in servers], dtype=float),
                np.array([s.bandwidth for s in servers], dtype=float), [s.cached for s in servers],
                [s.fetches for s in servers], state.key_stages, state.now)
        c.hosts_key = np.zeros(len(names), dtype=bool)
        for r in state.replicas:
            if r.server in index:
                c.count(r.stage)[index[r.server]] += 1
                if r.stage in state.key_stages:
                    c.hosts_key[index[r.server]] = True
        return c

    def count(self, stage: str) -> np.ndarray:
        if stage not in self.same:
            self.same[stage] = np.zeros(len(self.names))
        return self.same[stage]

    def cached_mask(self, stage: str) -> np.ndarray:
        if stage not in self._cached_masks:
            self._cached_masks[stage] = np.array([stage in c for c in self.cached], dtype=bool)
        return self._cached_masks[stage]

    def feasible(self, change: Change) -> np.ndarray:
        """Servers with a free slot where the replica can start: by fork, or cold within the
        deadline rule."""
        new = (change.shard_bytes, self.now + change.deadline_s)
        if new not in self.cold_ok:
            self.cold_ok[new] = np.array([self._admits(j, new) for j in range(len(self.names))], dtype=bool)
        return (self.free >= 1) & (self.cached_mask(change.stage) | self.cold_ok[new])

    def _admits(self, j: int, new: tuple[float, float]) -> bool:
        return admits(self.fetches[j], self.bandwidth[j], Fetch(*new), self.now)

    def place(self, change: Change, j: int, reason: str) -> Placement:
        cached = change.stage in self.cached[j]
        self.free[j] -= 1
        self.count(change.stage)[j] += 1
        if change.stage in self.key_stages:
            self.hosts_key[j] = True
        if not cached:
            self.fetches[j] = (*self.fetches[j], Fetch(change.shard_bytes, self.now + change.deadline_s))
            for new, ok in self.cold_ok.items():
                ok[j] = self._admits(j, new)
        return Placement(change.stage, self.names[j], "fork" if cached else "cold", reason)

    def why_not(self, change: Change) -> str:
        if not (self.free >= 1).any():
            return "no server has a free slot"
        return "no server with a free slot caches the stage or can cold-start it within its deadline"


class Scheduler:
    def __init__(self, params: SchedulerParams | None = None) -> None:
        self.params = params or SchedulerParams()

    def schedule(self, state: ClusterState, changes: list[Change]) -> Schedule:
        if not self.params.disperse:
            state = dataclasses.replace(state, key_stages=frozenset())
        cluster = _Cluster.of(state)
        adds = [c for c in changes if c.count > 0]
        wanted = sum(c.count for c in adds)
        heavy = wanted > self.params.heavy_above * max(1.0, float(cluster.free.sum()))
        removals = self._removals(state, [c for c in changes if c.count < 0])
        # Key stages first, so that the rest is packed around them.
        key = [c for c in adds if c.stage in state.key_stages]
        rest = [c for c in adds if c.stage not in state.key_stages]
        placements, unplaced, trace = [], [], []
        if heavy and key:
            trace = self._disperse(cluster, key, placements, unplaced)
        else:
            for change in key:
                self._greedy(cluster, change, self._key_score, "key stage: least crowded, cached, most free slots",
                             placements, unplaced)
        for change in rest:
            self._greedy(cluster, change, self._pack_score, "packed: best fit away from key stages",
                         placements, unplaced)
        sizes = {c.stage: c.shard_bytes for c in adds}
        return Schedule(choose_sources(tuple(placements), state, sizes, self.params.peer_blocks, self.params.peers),
                        tuple(removals),
                        tuple(unplaced), "heavy" if heavy else "light", tuple(trace))

    # -- light contention ----------------------------------------------------------------------

    def _key_score(self, c: _Cluster, stage: str) -> np.ndarray:
        crowd = c.count(stage) + self.params.cache_weight * ~c.cached_mask(stage)
        return crowd * 1e6 - c.free

    def _pack_score(self, c: _Cluster, stage: str) -> np.ndarray:
        return c.hosts_key * 1e9 + ~c.cached_mask(stage) * 1e6 + c.free

    def _greedy(self, c: _Cluster, change: Change, score, reason: str, placements: list, unplaced: list) -> None:
        for _ in range(change.count):
            feasible = c.feasible(change)
            if not feasible.any():
                unplaced.append((change.stage, c.why_not(change)))
                continue
            j = int(np.argmin(np.where(feasible, score(c, change.stage), np.inf)))
            placements.append(c.place(change, j, reason))

    # -- heavy contention ----------------------------------------------------------------------

    def _disperse(self, c: _Cluster, key: list[Change], placements: list, unplaced: list) -> list[float]:
        """One row per key-stage replica to add: P starts at the light placement, Q spreads each
        stage over servers in proportion to free slots, less where it already runs, more where
        it is cached; P descends towards Q and is rounded per stage."""
        p = self.params
        rows, start, targets = [], [], []
        room = c.free.copy()
        for i, change in enumerate(key):
            feasible = c.feasible(change)
            weight = np.where(feasible, room * (1 + p.cache_weight * c.cached_mask(change.stage))
                              / (1 + c.count(change.stage)), 0.0)
            if weight.sum() <= 0:
                unplaced.extend((change.stage, c.why_not(change)) for _ in range(change.count))
                continue
            order = np.argsort(np.where(feasible, self._key_score(c, change.stage), np.inf), kind="stable")
            for n in range(change.count):
                rows.append(i)
                targets.append(weight / weight.sum())
                start.append(order[n % max(1, int(feasible.sum()))])
        if not rows:
            return []
        fits = int(min(len(rows), room.sum()))
        for i in rows[fits:]:
            unplaced.append((key[i].stage, "no server has a free slot"))
        rows, targets, start = rows[:fits], np.array(targets[:fits]), start[:fits]
        P0 = np.full_like(targets, 0.05 / targets.shape[1])
        P0[np.arange(fits), start] += 0.95
        P, trace = descend(P0, targets, room, rate=p.kl_rate, threshold=p.kl_threshold, max_iters=p.kl_max_iters)
        for i in dict.fromkeys(rows):
            change, mine = key[i], np.array(rows) == i
            expected = P[mine].sum(axis=0)
            counts = round_counts(expected, int(mine.sum()), c.free.astype(int))
            prefer = list(np.argsort(-expected, kind="stable"))
            sequence = [j for j in prefer for _ in range(counts[j])]
            for j in sequence:
                feasible = c.feasible(change)
                if not feasible[j]:
                    others = [k for k in prefer if feasible[k]]
                    if not others:
                        unplaced.append((change.stage, c.why_not(change)))
                        continue
                    j = others[0]
                placements.append(c.place(change, j, "key stage: dispersed by KL descent"))
        return trace

    # -- scale down ----------------------------------------------------------------------------

    def _removals(self, state: ClusterState, shrinks: list[Change]) -> list[Removal]:
        pressure = {s.name for s in state.servers if s.memory_pressure}
        out = []
        for change in shrinks:
            mine = [r for r in state.replicas if r.stage == change.stage]
            crowd = Counter(r.server for r in mine)
            for _ in range(min(-change.count, len(mine))):
                victim = min(mine, key=lambda r: _removal_key(r, crowd, pressure))
                mine.remove(victim)
                crowd[victim.server] -= 1
                out.append(Removal(victim.id, victim.stage, victim.server, _removal_reason(victim, pressure)))
        return out


def _removal_key(r: PlacedReplica, crowd: Counter, pressure: set[str]) -> tuple:
    frees_memory = r.started_by == "cold" and r.server in pressure
    return (r.ready, -crowd[r.server], not frees_memory, -r.started_at, r.id)


def _removal_reason(r: PlacedReplica, pressure: set[str]) -> str:
    if not r.ready:
        return "still starting"
    if r.started_by == "cold" and r.server in pressure:
        return "cold replica on a server short of memory"
    return "on the server where the stage is most crowded"
