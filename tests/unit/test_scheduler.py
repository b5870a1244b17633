"""The placement policy on hand-made and generated cluster states: capacity, the KL descent,
determinism, dispersion against first-fit, cache preference, HydraServe's deadline rule and the
order in which replicas leave."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from scheduler import generate
from scheduler.baselines import FirstFit, RandomFit
from scheduler.evaluate import apply, dispersion
from scheduler.fetch import admits, progress
from scheduler.kl import descend, kl_divergence, round_counts
from scheduler.placement import Scheduler, SchedulerParams
from scheduler.state import Change, ClusterState, Fetch, PlacedReplica, ReplicaId, Server, ServerView, cluster_state

KEY = "m:3"


def replica_at(name: str, stage: str, server: str, *more, **named) -> PlacedReplica:
    return PlacedReplica(ReplicaId(server, name=name), stage, server, *more, **named)


def servers(n: int, slots: int = 4, cached: dict[int, set[str]] | None = None, **kw) -> tuple[Server, ...]:
    cached = cached or {}
    return tuple(Server(f"s{j}", slots, cached=frozenset(cached.get(j, ())), **kw) for j in range(n))


def used_per_server(state: ClusterState) -> Counter:
    return Counter(r.server for r in state.replicas)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("instances", [10, 200, 2000])
def test_capacity_is_never_exceeded(seed, instances):
    state = generate.cluster(50, slots=8, occupancy=0.5, seed=seed)
    changes = generate.burst(state, instances, seed=seed)
    schedule = Scheduler().schedule(state, changes)
    after = apply(state, schedule)
    slots = {s.name: s.slots for s in state.servers}
    assert all(n <= slots[name] for name, n in used_per_server(after).items())
    free = sum(slots.values()) - len(state.replicas)
    # Everything that fits is placed; the rest is reported, not lost.
    assert len(schedule.placements) == min(instances, free)
    assert len(schedule.placements) + len(schedule.unplaced) == instances


def test_the_kl_objective_never_increases():
    rng = np.random.default_rng(0)
    for _ in range(20):
        n, m = int(rng.integers(2, 40)), int(rng.integers(2, 30))
        capacity = rng.integers(1, 6, size=m).astype(float)
        if capacity.sum() < n:
            capacity[0] += n
        P = rng.dirichlet(np.full(m, 0.2), size=n)
        Q = rng.dirichlet(np.ones(m), size=n)
        P2, trace = descend(P, Q, capacity, rate=0.9, max_iters=60)
        assert all(b <= a + 1e-9 for a, b in zip(trace, trace[1:])), trace
        assert trace[-1] < trace[0]
        assert np.allclose(P2.sum(axis=1), 1.0) and (P2 >= 0).all()
        assert (P2.sum(axis=0) <= capacity * (1 + 1e-3)).all()
        assert kl_divergence(Q, Q) == pytest.approx(0.0, abs=1e-9)


def test_rounding_keeps_the_total_within_room():
    counts = round_counts(np.array([2.6, 0.3, 1.1]), 4, np.array([2, 5, 5]))
    # Floors [2, 0, 1]; the largest remainder (0.6) is at a stage already at its room of 2, so
    # the fourth goes to the next largest (0.3).
    assert counts.tolist() == [2, 1, 1]
    assert round_counts(np.array([1.0, 1.0]), 5, np.array([1, 1])).sum() == 2


def test_results_are_deterministic_for_a_seed():
    a, b = generate.cluster(40, seed=7), generate.cluster(40, seed=7)
    assert a == b
    changes = generate.burst(a, 100, seed=7)
    assert Scheduler().schedule(a, changes) == Scheduler().schedule(b, changes)
    assert RandomFit(3).schedule(a, changes) == RandomFit(3).schedule(a, changes)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("instances", [60, 400])  # light and heavy contention
def test_key_stages_end_more_dispersed_than_under_first_fit(seed, instances):
    state = generate.cluster(100, slots=8, occupancy=0.4, seed=seed)
    changes = generate.burst(state, instances, seed=seed)
    ours = Scheduler().schedule(state, changes)
    assert ours.contention == ("light" if instances == 60 else "heavy")
    first = FirstFit().schedule(state, changes)
    d_ours, d_first = dispersion(apply(state, ours), ours), dispersion(apply(state, first), first)
    assert d_ours.max_share < d_first.max_share
    assert d_ours.entropy > d_first.entropy
    assert d_ours.fork_share > d_first.fork_share


def test_heavy_contention_descends_on_kl():
    state = generate.cluster(20, slots=4, occupancy=0.5, seed=1)
    schedule = Scheduler().schedule(state, [Change("model0:3", 30)])
    assert schedule.contention == "heavy"
    assert len(schedule.kl_trace) >= 2 and schedule.kl_trace[-1] < schedule.kl_trace[0]
    assert all(p.reason == "key stage: dispersed by KL descent" for p in schedule.placements)


def test_the_cache_is_preferred_when_dispersion_allows():
    state = ClusterState(servers(3, cached={2: {KEY}}), key_stages=frozenset({KEY}))
    schedule = Scheduler().schedule(state, [Change(KEY, 1)])
    assert [(p.server, p.path) for p in schedule.placements] == [("s2", "fork")]


def test_dispersion_wins_over_the_cache_when_the_cached_server_is_crowded():
    crowded = tuple(replica_at(f"r{i}", KEY, "s0") for i in range(2))
    state = ClusterState(servers(3, slots=8, cached={0: {KEY}}), crowded, frozenset({KEY}))
    placed = Scheduler().schedule(state, [Change(KEY, 1)]).placements
    assert placed[0].server != "s0" and placed[0].path == "cold"


def test_key_stage_replicas_spread_over_servers_that_cache_it():
    state = ClusterState(servers(4, slots=8, cached={0: {KEY}, 1: {KEY}, 2: {KEY}}), key_stages=frozenset({KEY}))
    placed = Scheduler().schedule(state, [Change(KEY, 3)]).placements
    assert sorted(p.server for p in placed) == ["s0", "s1", "s2"] and {p.path for p in placed} == {"fork"}


def test_without_dispersion_key_stage_replicas_are_packed_like_the_rest():
    """QUART_ABLATE=dispersion: the same request as above lands best-fit, on one server."""
    state = ClusterState(servers(4, slots=8, cached={0: {KEY}, 1: {KEY}, 2: {KEY}}), key_stages=frozenset({KEY}))
    placed = Scheduler(SchedulerParams(disperse=False)).schedule(state, [Change(KEY, 3)]).placements
    assert len({p.server for p in placed}) == 1 and {p.reason for p in placed} == {"packed: best fit away from key stages"}
    heavy = generate.cluster(20, slots=4, occupancy=0.5, seed=1)
    schedule = Scheduler(SchedulerParams(disperse=False)).schedule(heavy, [Change("model0:3", 30)])
    assert schedule.kl_trace == () and len(schedule.placements) == 30


def test_other_stages_are_packed_away_from_key_stages():
    state = ClusterState(servers(3, slots=4), (replica_at("k", KEY, "s0"), replica_at("a", "m:1", "s1")),
                         frozenset({KEY}))
    placed = Scheduler().schedule(state, [Change("m:5", 2)]).placements
    # Best fit: the fullest server that hosts no key stage, not s0 where the key stage grows.
    assert [p.server for p in placed] == ["s1", "s1"]


def test_the_deadline_rule_refuses_a_server_whose_fetches_would_be_late():
    # 1 GB/s; a fetch with 8 GB left and 10 s to go meets its deadline alone (and at half the
    # bandwidth it would need 16 s, so a second fetch may not join).
    busy = Fetch(8e9, deadline=10.0)
    assert admits((), 1e9, busy, now=0.0)
    assert not admits((busy,), 1e9, Fetch(1e9, 60.0), now=0.0)
    assert admits((Fetch(4e9, 10.0),), 1e9, Fetch(1e9, 60.0), now=0.0)
    state = ClusterState((Server("s0", 4, 1e9, fetches=(busy,)), Server("s1", 4, 1e9)))
    placed = Scheduler().schedule(state, [Change("m:1", 1, shard_bytes=1e9, deadline_s=60)]).placements
    assert [p.server for p in placed] == ["s1"]
    nowhere = ClusterState((Server("s0", 4, 1e9, fetches=(busy,)),))
    schedule = Scheduler().schedule(nowhere, [Change("m:1", 1, shard_bytes=1e9, deadline_s=60)])
    assert not schedule.placements and "deadline" in schedule.unplaced[0][1]
    # A fork needs no fetch: the same server takes it when it caches the stage.
    cached = ClusterState((Server("s0", 4, 1e9, cached=frozenset({"m:1"}), fetches=(busy,)),))
    assert Scheduler().schedule(cached, [Change("m:1", 1, 1e9)]).placements[0].path == "fork"


def test_fetch_progress_shares_the_bandwidth():
    left = progress((Fetch(3e9, 10), Fetch(1e9, 10)), 2e9, since=0.0, now=1.0)
    assert left == (Fetch(2e9, 10),)


def test_scale_down_keeps_dispersion_and_frees_memory_first():
    replicas = (replica_at("a", KEY, "s0", "fork-cow", started_at=1), replica_at("b", KEY, "s0", "fork-cow", started_at=2),
                replica_at("c", KEY, "s1", "cold", started_at=3), replica_at("d", KEY, "s1", "fork-cow", started_at=4),
                replica_at("e", KEY, "s2", "fork-cow", started_at=5), replica_at("f", KEY, "s0", "fork-cow", ready=False))
    state = ClusterState((Server("s0", 8), Server("s1", 8, memory_pressure=True), Server("s2", 8)), replicas,
                         frozenset({KEY}))
    removed = Scheduler().schedule(state, [Change(KEY, -3)]).removals
    # The starting one first; then s0 and s1 hold two each, and the cold replica on the server
    # short of memory goes before the others; then s0 is the most crowded, its newest goes.
    assert [str(r.replica) for r in removed] == ["f", "c", "b"]
    assert [r.reason for r in removed][0] == "still starting"


def test_params_change_the_trade_off():
    state = ClusterState(servers(2, slots=8, cached={0: {KEY}}), (replica_at("r", KEY, "s0"),), frozenset({KEY}))
    # With a fork worth 2 replicas of dispersion, the cached server takes the second replica.
    placed = Scheduler(SchedulerParams(cache_weight=2.0)).schedule(state, [Change(KEY, 1)]).placements
    assert placed[0].server == "s0"
    placed = Scheduler(SchedulerParams(cache_weight=0.5)).schedule(state, [Change(KEY, 1)]).placements
    assert placed[0].server == "s1"


def test_one_cluster_view_for_every_backend():
    """Draining replicas keep their slots but leave the scheduler's count; a full cache is memory pressure."""
    views = [ServerView("a", 4, 1e9, frozenset({"m:0"}), 900), ServerView("b", 4, 1e9, cached_bytes=100)]
    replicas = [(replica_at("r1", "m:0", "a"), False), (replica_at("r2", "m:0", "a"), True), (replica_at("r3", "m:1", "b"), True)]
    state = cluster_state(views, replicas, ["m:0"], 5.0, cache_budget=900)
    assert [(s.name, s.slots, s.memory_pressure) for s in state.servers] == [("a", 3, True), ("b", 3, False)]
    assert [str(r.id) for r in state.replicas] == ["r1"] and state.key_stages == {"m:0"} and state.now == 5.0
    unbounded = cluster_state(views, [], [], 0.0, cache_budget=0)
    assert not any(s.memory_pressure for s in unbounded.servers) and [s.slots for s in unbounded.servers] == [4, 4]
