"""λScale's locality-driven start (scheduler/peer_start.py): a round's cold placements of a stage
become one multicast from the servers that cache it when that beats the model store, with the
prediction each path is chosen by."""
from __future__ import annotations

import pytest

from contracts.config import ConfigError
from scheduler.multicast import plan
from scheduler.peer_start import choose_sources, cold_seconds
from scheduler.placement import Scheduler, SchedulerParams
from scheduler.state import Change, ClusterState, PlacedReplica, Placement, ReplicaId, Server

GB = 1e9
LINK = 1e9


def cluster(store: float, cached_on: tuple[str, ...] = ("s0",), n: int = 5) -> ClusterState:
    return ClusterState(tuple(Server(f"s{i}", 4, LINK, frozenset({"m:1"} if f"s{i}" in cached_on else ()))
                              for i in range(n)), store_bandwidth=store)


def cold(*servers: str, stage: str = "m:1") -> tuple[Placement, ...]:
    return tuple(Placement(stage, s, "cold", "key stage") for s in servers)


def test_several_targets_receive_from_the_holder_when_the_store_is_the_bottleneck():
    chosen = choose_sources(cold("s1", "s2", "s3", "s4"), cluster(store=LINK), {"m:1": GB}, blocks=8)
    assert {p.path for p in chosen} == {"peer"}
    assert all(p.sources == ("s0",) for p in chosen)
    # One holder, four targets, eight blocks: 8 + log2(4) - 1 = 10 rounds of an eighth each,
    # against four reads sharing the store's link.
    assert chosen[0].predicted_s == pytest.approx(plan(["s0"], ["s1", "s2", "s3", "s4"], 8).seconds(GB, LINK))
    assert chosen[0].predicted_s == pytest.approx(10 / 8)
    assert cold_seconds(GB, 4 * GB, LINK, LINK) == pytest.approx(4.0)
    assert "peer from s0" in chosen[0].reason


def test_the_store_wins_where_it_is_as_fast_as_a_peer_or_no_server_holds_the_stage():
    one = choose_sources(cold("s1"), cluster(store=LINK), {"m:1": GB}, blocks=8)
    assert [p.path for p in one] == ["cold"] and one[0].predicted_s == pytest.approx(1.0)
    fast_store = choose_sources(cold("s1", "s2", "s3"), cluster(store=10 * LINK), {"m:1": GB}, blocks=8)
    assert {p.path for p in fast_store} == {"cold"}
    nobody = choose_sources(cold("s1", "s2", "s3"), cluster(store=LINK, cached_on=()), {"m:1": GB}, blocks=8)
    assert {p.path for p in nobody} == {"cold"} and nobody[0].sources == ()
    assert nobody[0].predicted_s == pytest.approx(3.0)


def test_servers_that_read_their_own_disks_never_start_from_peers_nor_where_peers_are_ablated():
    placements = cold("s1", "s2", "s3", "s4")
    assert choose_sources(placements, cluster(store=0.0), {"m:1": GB}, blocks=8) == placements
    ablated = choose_sources(placements, cluster(store=LINK), {"m:1": GB}, blocks=8, peers=False)
    assert {p.path for p in ablated} == {"cold"} and ablated[0].predicted_s == pytest.approx(4.0)


def test_forks_are_left_alone_and_every_holder_sends():
    placements = (Placement("m:1", "s0", "fork", "cached"), *cold("s2", "s3", "s4"))
    chosen = choose_sources(placements, cluster(store=LINK / 4, cached_on=("s0", "s1")), {"m:1": GB}, blocks=4)
    assert chosen[0] == placements[0]
    assert [p.path for p in chosen[1:]] == ["peer"] * 3
    assert all(p.sources == ("s0", "s1") for p in chosen[1:])


def test_the_scheduler_makes_a_key_stages_burst_a_multicast_from_where_it_is_cached():
    state = cluster(store=LINK / 2)
    state = ClusterState(state.servers, (PlacedReplica(ReplicaId("s0", 1), "m:1", "s0", "fork-cow"),),
                         frozenset({"m:1"}), 0.0, state.store_bandwidth)
    schedule = Scheduler(SchedulerParams(peer_blocks=8)).schedule(state, [Change("m:1", 4, GB, 60.0)])
    assert len(schedule.placements) == 4
    for p in schedule.placements:
        assert (p.path, p.sources) == (("fork", ()) if p.server == "s0" else ("peer", ("s0",))), p
    assert any(p.path == "peer" for p in schedule.placements)


def test_a_round_shares_the_store_between_stages_and_a_holders_link_between_its_sends():
    both = frozenset({"m:1", "m:2"})
    state = ClusterState((Server("s0", 4, LINK, both), Server("s1", 4, LINK), Server("s2", 4, LINK)),
                         store_bandwidth=LINK)
    placements = (Placement("m:1", "s1", "cold", "key"), Placement("m:2", "s2", "cold", "key"))
    chosen = choose_sources(placements, state, {"m:1": GB, "m:2": GB}, blocks=8)
    # Both from the store: 2 s (its link carries both). The first to go peer takes 1 s and leaves the
    # store to the other (1 s); a second send from s0 would share its uplink (2 s): no gain.
    assert sorted(p.path for p in chosen) == ["cold", "peer"]
    assert all(p.predicted_s == pytest.approx(1.0) for p in chosen)
    # Holding a stage each, two holders send both at once.
    split = ClusterState((Server("s0", 4, LINK, frozenset({"m:1"})), Server("s3", 4, LINK, frozenset({"m:2"})),
                          Server("s1", 4, LINK), Server("s2", 4, LINK)), store_bandwidth=LINK / 2)
    assert [p.path for p in choose_sources(placements, split, {"m:1": GB, "m:2": GB}, blocks=8)] == ["peer", "peer"]


def test_a_peer_start_needs_at_least_one_block():
    with pytest.raises(ConfigError, match="peer_blocks"):
        SchedulerParams.of({"peer_blocks": 0})
