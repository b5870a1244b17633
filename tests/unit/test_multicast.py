"""λScale's multicast planner (scheduler/multicast.py), checked by replaying each plan: a server
sends only blocks it holds, sends and receives at most one block a round, holders receive
nothing, and every target ends with every block, in the round count λScale's model gives."""
from __future__ import annotations

import math

import pytest

from scheduler.multicast import (
    MulticastPlan,
    binary_tree_plan,
    binary_tree_rounds,
    block_pieces,
    chunk_orders,
    elbow_blocks,
    execution_pipelines,
    lower_bound_rounds,
    plan,
    pulls_by_target,
    subgroups,
    unicast_plan,
    unicast_rounds,
)


def replay(p: MulticastPlan, holders: list[str], targets: list[str]) -> dict[str, set[int]]:
    have = {s: set(range(p.blocks)) for s in holders} | {s: set() for s in targets}
    for index, transfers in enumerate(p.rounds):
        sources = [t.source for t in transfers]
        receivers = [t.target for t in transfers]
        assert len(set(sources)) == len(sources), f"round {index}: a server sends twice"
        assert len(set(receivers)) == len(receivers), f"round {index}: a server receives twice"
        for t in transfers:
            assert t.block in have[t.source], f"round {index}: {t.source} sends block {t.block} it lacks"
            assert t.target in targets, f"round {index}: {t.target} is not a target"
            assert t.block not in have[t.target], f"round {index}: {t.target} gets block {t.block} twice"
        for t in transfers:
            have[t.target].add(t.block)
    return have


def servers(n: int) -> list[str]:
    return [f"vm-{i}" for i in range(n)]


@pytest.mark.parametrize("n", [2, 4, 8, 16, 32, 64])
@pytest.mark.parametrize("blocks", [1, 2, 4, 7, 16, 32])
def test_one_holder_to_a_power_of_two_takes_b_plus_log_n_minus_one_rounds(n, blocks):
    names = servers(n)
    p = plan(names[:1], names[1:], blocks)
    have = replay(p, names[:1], names[1:])
    assert all(h == set(range(blocks)) for h in have.values())
    assert len(p.rounds) == blocks + int(math.log2(n)) - 1 == lower_bound_rounds(n, blocks)


@pytest.mark.parametrize("n", [3, 5, 6, 7, 9, 12, 13, 20, 33, 47, 63])
@pytest.mark.parametrize("blocks", [1, 3, 8, 16, 32])
def test_other_sizes_take_at_most_one_round_more(n, blocks):
    names = servers(n)
    p = plan(names[:1], names[1:], blocks)
    have = replay(p, names[:1], names[1:])
    assert all(h == set(range(blocks)) for h in have.values())
    assert lower_bound_rounds(n, blocks) <= len(p.rounds) <= lower_bound_rounds(n, blocks) + 1


def test_algorithm_1_shifts_the_chunks_per_subgroup():
    assert chunk_orders(1, 4) == [[0, 1, 2, 3]]
    assert chunk_orders(2, 4) == [[0, 1, 2, 3], [2, 3, 0, 1]]  # λScale's Fig. 5
    assert chunk_orders(3, 7) == [[0, 1, 2, 3, 4, 5, 6], [3, 4, 5, 6, 0, 1, 2], [6, 0, 1, 2, 3, 4, 5]]
    assert all(sorted(o) == list(range(10)) for o in chunk_orders(4, 10))


def test_k_holders_split_the_targets_and_their_first_blocks_differ():
    names = servers(8)
    p = plan(names[:2], names[2:], 4)
    assert p.groups == (("vm-0", "vm-2", "vm-4", "vm-6"), ("vm-1", "vm-3", "vm-5", "vm-7"))
    have = replay(p, names[:2], names[2:])
    assert all(h == set(range(4)) for h in have.values())
    # Each sub-group of 4 runs its own pipeline: b + log2(4) - 1 rounds, both at once.
    assert len(p.rounds) == 4 + 2 - 1
    first = {t.target: t.block for t in p.rounds[0]}
    assert first == {"vm-2": 0, "vm-3": 2}
    # Within each sub-group every transfer stays inside it.
    group_of = {s: i for i, g in enumerate(p.groups) for s in g}
    assert all(group_of[t.source] == group_of[t.target] for r in p.rounds for t in r)


def test_a_plan_finishes_sooner_than_the_tree_and_far_sooner_than_unicast():
    for n, blocks in ((8, 16), (8, 32), (16, 16)):
        rounds = len(plan(servers(n)[:1], servers(n)[1:], blocks).rounds)
        assert binary_tree_rounds(n, blocks) >= 1.5 * rounds, (n, blocks)
        assert unicast_rounds(n, blocks) == (n - 1) * blocks
    assert binary_tree_rounds(2, 5) == 5 and binary_tree_rounds(3, 2) == 4


def test_the_plan_time_and_each_targets_completion():
    p = plan(["a"], ["b", "c", "d"], 8)
    assert p.seconds(800e6, 100e6) == pytest.approx(len(p.rounds) * 1.0)
    done = p.complete_after()
    assert set(done) == {"b", "c", "d"} and max(done.values()) == len(p.rounds)


def test_bad_plans_are_refused():
    with pytest.raises(ValueError, match="at least one holder"):
        plan([], ["b"], 4)
    with pytest.raises(ValueError, match="distinct"):
        plan(["a"], ["a", "b"], 4)
    with pytest.raises(ValueError, match="at least one block"):
        plan(["a"], ["b"], 0)
    assert plan(["a"], [], 4).rounds == ()


def test_subgroups_spread_the_remainder():
    assert subgroups(["h0", "h1", "h2"], list("abcdefg")) == [["h0", "a", "d", "g"], ["h1", "b", "e"], ["h2", "c", "f"]]


def test_the_elbow_is_where_more_blocks_stop_paying():
    assert elbow_blocks({4: 10.0, 8: 6.0, 16: 5.6, 32: 5.5}) == 8
    assert elbow_blocks({4: 10.0, 8: 8.0, 16: 6.0}) == 16
    assert elbow_blocks({4: 10.0}) == 4


def test_algorithm_2_forms_pipelines_across_subgroups():
    groups = [["3", "4", "5"], ["6", "7", "8"]]  # λScale's Fig. 5: 2 -> 8, targets only
    assert execution_pipelines(groups) == [["3", "6"], ["4", "7"], ["5", "8"]]
    assert execution_pipelines([["a", "b", "c"], ["d"]]) == [["a", "d"], ["b", "c"]]
    assert execution_pipelines([["a", "b"]]) == [["a", "b"]]
    assert execution_pipelines([]) == []


def test_blocks_are_even_runs_of_whole_pieces():
    assert [block_pieces(10, 4, i) for i in range(4)] == [(0, 2), (2, 5), (5, 7), (7, 10)]
    assert [block_pieces(3, 3, i) for i in range(3)] == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(ValueError, match="1 to 3 blocks"):
        block_pieces(3, 4, 0)
    with pytest.raises(ValueError, match="not one of"):
        block_pieces(8, 4, 4)


def test_each_target_executes_its_transfers_in_round_order():
    p = plan(["a"], ["b", "c", "d"], 2)
    steps = pulls_by_target(p)
    assert set(steps) == {"b", "c", "d"}
    for target, pulls in steps.items():
        assert sorted(s.block for s in pulls) == [0, 1]
        expected = [(t.source, t.block, i) for i, r in enumerate(p.rounds) for t in r if t.target == target]
        assert [(s.source, s.block, s.round) for s in pulls] == expected


def test_each_pull_names_its_sources_send_before_it():
    p = plan(["a"], servers(7), 4)
    sends: dict[str, list[int]] = {}
    for index, transfers in enumerate(p.rounds):
        for t in transfers:
            sends.setdefault(t.source, []).append(index)
    for pulls in pulls_by_target(p).values():
        for step in pulls:
            mine = sends[step.source]
            at = mine.index(step.round)
            assert step.after == (mine[at - 1] if at else -1)
    holder_rounds = [s.round for pulls in pulls_by_target(p).values() for s in pulls if s.source == "a"]
    assert sorted(holder_rounds) == list(range(len(holder_rounds)))  # one send a round from round 0 on


def test_the_baselines_plans_replay_to_every_block_everywhere():
    names = servers(7)
    for p in (binary_tree_plan(names[0], names[1:], 5), unicast_plan(names[0], names[1:], 5)):
        have = replay(p, names[:1], names[1:])
        assert all(h == set(range(5)) for h in have.values())
    tree = binary_tree_plan(names[0], names[1:], 5)
    assert {t.source for r in tree.rounds for t in r if t.target == "vm-3"} == {"vm-1"}  # 3's parent is 1
    assert len(unicast_plan(names[0], names[1:], 5).rounds) == 6 * 5
