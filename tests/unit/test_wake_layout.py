"""The layout a model wakes in (Algorithm 1 over its declared sizes), by hand: 2 GB over 4
servers at 0.5 GB/s. Whole: the fetch (4 s) bounds the start, then the prefill: 4.2 s. Its 4 stage
functions: 0.5 GB each (1 s), hidden behind 2 s of imports: 2.2 s."""
from __future__ import annotations

import pytest

from scheduler.coldstart import ColdServer, ColdStartCosts, allocate
from scheduler.wake_layout import choose

COSTS = ColdStartCosts(create_s=0.0, libraries_s=2.0, prefill_s=0.2, decode_s=0.05, hop_s=0.0)
GB = 1e9


def servers(n: int, free: int | None = None) -> list[ColdServer]:
    free = n if free is None else free
    return [ColdServer(f"s{i}", 0.5 * GB, float("inf"), fits_full=i < free) for i in range(n)]


def test_the_whole_model_wakes_where_it_meets_the_objective_being_fewest_replicas():
    choice = choose(COSTS, 2 * GB, servers(4), stages=4, slo_ttft_s=5.0)
    assert choice.whole and choice.plan.servers == ("s0",)
    assert choice.predicted == pytest.approx({1: 4.2, 4: 2.2})
    assert "woken whole" in choice.reason and "within the 5 s TTFT objective" in choice.reason
    assert choice.reason.endswith("(else 4 stages 2.2 s)")


def test_the_stage_functions_wake_where_only_they_meet_it():
    choice = choose(COSTS, 2 * GB, servers(4), stages=4, slo_ttft_s=3.0)
    assert not choice.whole and choice.plan.size == 4 and len(set(choice.plan.servers)) == 4
    assert choice.plan.ttft_s == pytest.approx(2.2)
    assert "as its 4 stage functions" in choice.reason and "(else whole 4.2 s)" in choice.reason


def test_without_an_objective_every_layout_meets_it_and_the_whole_model_wakes():
    choice = choose(COSTS, 2 * GB, servers(4), stages=4, slo_ttft_s=None)
    assert choice.whole and "no TTFT objective" in choice.reason


def test_stages_need_a_free_server_each_else_the_whole_model_wakes_even_late():
    choice = choose(COSTS, 2 * GB, servers(4, free=3), stages=4, slo_ttft_s=3.0)
    assert choice.whole and set(choice.predicted) == {1}
    assert "no layout meets the 3 s TTFT objective" in choice.reason and "the only layout with room" in choice.reason
    with pytest.raises(ValueError):
        choose(COSTS, 2 * GB, servers(4, free=0), stages=4, slo_ttft_s=3.0)


def test_where_no_layout_meets_it_the_whole_model_wakes_hydraserves_fallback():
    choice = choose(COSTS, 2 * GB, servers(4), stages=4, slo_ttft_s=1.0)
    assert choice.whole and "HydraServe's fallback" in choice.reason


def test_allocate_considers_only_the_sizes_given():
    for slo in (1.0, 3.0, 100.0):
        assert allocate(COSTS, 2 * GB, servers(4), slo, 10.0, sizes=(1, 4)).size in (1, 4)
    assert allocate(COSTS, 2 * GB, servers(4), 100.0, 10.0, sizes=(3,)).size == 3


def test_on_one_hosts_cores_four_workers_import_four_times_and_the_stages_lose_their_lead():
    # 4 × 2 s of imports plus the prefill over 2 shared cores: 4.1 s for the stages, against 4.2 s whole
    shared = choose(COSTS, 2 * GB, servers(4), stages=4, slo_ttft_s=3.0, shared_cores=2)
    assert shared.predicted == pytest.approx({1: 4.2, 4: 4.1})
    assert shared.whole and "HydraServe's fallback" in shared.reason
    # and a fetched byte's CPU (1 s/GB) adds 1 s to either
    assert choose(COSTS, 2 * GB, servers(4), 4, None, shared_cores=2, cpu_per_byte=1 / GB).predicted[4] == pytest.approx(5.1)
