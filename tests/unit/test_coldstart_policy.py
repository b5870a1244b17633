"""HydraServe's cold-start predictors (Eq. 1, 2, 5) and resource allocation (Algorithm 1), by hand."""
from __future__ import annotations

import pytest

from scheduler.coldstart import (
    ColdServer,
    ColdStartCosts,
    allocate,
    compute_factor,
    stage_ranges,
    tpot,
    ttft_overlapped,
    ttft_sequential,
)

COSTS = ColdStartCosts(create_s=1.0, libraries_s=3.0, prefill_s=0.4, decode_s=0.05, hop_s=0.01)
GB = 1e9


def servers(n: int, bandwidth: float = 0.5 * GB, load_rate: float = 4 * GB, **kw) -> list[ColdServer]:
    return [ColdServer(f"s{i}", bandwidth, load_rate, **kw) for i in range(n)]


def test_eq1_adds_runtime_fetch_and_load_of_one_part_and_the_prefill():
    # (1 + 3) + 2 GB / 2 * (1/0.5 + 1/4 per GB) + 0.4 * (2 - 2 + 2/2) + 0.01 * 2
    assert ttft_sequential(COSTS, 2 * GB, servers(2), full=2) == pytest.approx(4 + 2.25 + 0.4 + 0.02)
    # partial workers compute at 1/s of the speed: the prefill takes s times as long
    assert ttft_sequential(COSTS, 2 * GB, servers(2), full=0) == pytest.approx(4 + 2.25 + 0.8 + 0.02)


def test_eq5_hides_the_runtime_behind_the_fetch_or_the_fetch_behind_it():
    # fetch of 1 GB at 0.5 GB/s (2 s) is shorter than start + imports (1 + 3): the imports bound it
    assert ttft_overlapped(COSTS, 2 * GB, servers(2), full=2) == pytest.approx(4 + 0.4 + 0.02)
    # a slow link: the fetch (8 s) bounds it
    slow = servers(2, bandwidth=0.125 * GB)
    assert ttft_overlapped(COSTS, 2 * GB, slow, full=2) == pytest.approx(8 + 0.4 + 0.02)


def test_the_slowest_server_sets_the_pace():
    mixed = [ColdServer("fast", 1 * GB, 4 * GB), ColdServer("slow", 0.25 * GB, 4 * GB)]
    assert ttft_sequential(COSTS, 2 * GB, mixed, 2) == pytest.approx(4 + 1 * (4 + 0.25) + 0.4 + 0.02)


def test_eq2_and_the_compute_factor():
    assert compute_factor(1, 1) == 1 and compute_factor(4, 4) == 1 and compute_factor(4, 0) == 4
    assert tpot(COSTS, 4, 4) == pytest.approx(0.05 + 0.04)
    assert tpot(COSTS, 4, 0) == pytest.approx(0.2 + 0.04)


def test_algorithm1_takes_the_least_memory_that_meets_both_slos():
    # every plan of partial workers holds one model's memory, as one full worker does; of those,
    # four partial workers fetch soonest (5.64 s against 16.41 s for one)
    plan = allocate(COSTS, 8 * GB, servers(4), slo_ttft_s=100.0, slo_tpot_s=1.0)
    assert (plan.size, plan.full, plan.memory) == (4, 0, 1.0) and plan.ttft_s == pytest.approx(5.64)
    # a tight TPOT rules out partial workers; of the full ones meeting 6 s, three use the least
    plan = allocate(COSTS, 8 * GB, servers(4), slo_ttft_s=6.0, slo_tpot_s=0.1)
    assert (plan.size, plan.full, plan.memory) == (3, 3, 3.0) and plan.ttft_s <= 6.0 and plan.tpot_s <= 0.1
    assert len(set(plan.servers)) == 3  # each worker on a server of its own


def test_algorithm1_puts_full_workers_on_the_fastest_servers_that_fit_them():
    pool = [ColdServer("slow", 0.1 * GB, 4 * GB), ColdServer("fast", 2 * GB, 4 * GB),
            ColdServer("small", 5 * GB, 4 * GB, fits_full=False)]
    plan = allocate(COSTS, 2 * GB, pool, slo_ttft_s=100.0, slo_tpot_s=100.0, max_size=1)
    assert plan.servers == ("fast",)
    quick = ColdStartCosts(create_s=1.0, libraries_s=0.5, prefill_s=0.4, decode_s=0.05, hop_s=0.01)
    # one worker on "fast" needs 2.41 s; two partial ones on the two fastest servers 2.32 s
    plan = allocate(quick, 4 * GB, pool, slo_ttft_s=2.35, slo_tpot_s=100.0, max_size=2)
    assert (plan.size, plan.full, set(plan.servers)) == (2, 0, {"fast", "small"})


def test_algorithm1_falls_back_to_one_full_worker_when_nothing_meets_the_slos():
    plan = allocate(COSTS, 8 * GB, servers(4), slo_ttft_s=0.1, slo_tpot_s=0.001)
    assert (plan.size, plan.full) == (1, 1)
    with pytest.raises(ValueError):
        allocate(COSTS, 8 * GB, servers(2, fits_full=False, fits_part=False), 1.0, 1.0)


def test_stage_ranges_split_evenly():
    assert stage_ranges(4, 1) == [(0, 4)]
    assert stage_ranges(4, 2) == [(0, 2), (2, 4)]
    assert stage_ranges(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert stage_ranges(8, 3) == [(0, 3), (3, 5), (5, 8)]
    with pytest.raises(ValueError):
        stage_ranges(2, 3)


def test_the_fetch_deadline_is_the_ttft_objective_less_what_follows_the_fetch():
    from contracts.stack import ttft_slo_s
    from scheduler.coldstart import fetch_deadline_s
    from scheduler.state import fetches_under_way

    assert fetch_deadline_s(None, 3.0, 60.0) == 60.0
    assert fetch_deadline_s(10.0, 3.0, 60.0) == 7.0
    assert fetch_deadline_s(2.0, 3.0, 60.0) == 1.0
    assert ttft_slo_s({"com.quart.ttft-slo": "1m30s"}) == 90.0 and ttft_slo_s({}) is None
    for bad in ("soon", "0s", ""):
        with pytest.raises(ValueError, match="com.quart.ttft-slo"):
            ttft_slo_s({"com.quart.ttft-slo": bad})
    a, b = fetches_under_way([(100.0, 0.0), (100.0, 1.0)], 10.0, 60.0, 2.0, [5.0, 20.0])
    assert (a.deadline, b.deadline) == (5.0, 21.0) and a.pending_bytes == 90.0
