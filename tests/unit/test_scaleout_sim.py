"""The scale-out simulator (sim/scaleout.py): its transfers take what the live planner's rounds
say, execute-while-load answers before any member holds the model, a switch to local execution
neither loses nor repeats a token, and the shared autoscaling rule stays within the cluster."""
from __future__ import annotations

import math

import numpy as np
import pytest

from scheduler.multicast import binary_tree_plan, plan
from sim.scaleout import MODELS, SYSTEMS, Fabric, Job, burst, burstgpt_like, jobs_at, servers_wanted, simulate, start_plan

MODEL = MODELS["llama2-13b"]
FABRIC = Fabric()
ROUND_S = MODEL.bytes / FABRIC.blocks / FABRIC.link_bytes_s


def names(xs):
    return [str(x) for x in xs]


def test_multicast_and_tree_take_the_planners_rounds():
    targets = list(range(1, 8))
    binomial = start_plan(SYSTEMS["multicast"], FABRIC, MODEL, [0], targets, set())
    tree = start_plan(SYSTEMS["faasnet"], FABRIC, MODEL, [0], targets, set())
    done = plan(["0"], names(targets), FABRIC.blocks).complete_after()
    assert binomial.whole == pytest.approx({t: done[str(t)] * ROUND_S for t in targets})
    assert max(tree.whole.values()) == pytest.approx(len(binary_tree_plan("0", names(targets), FABRIC.blocks).rounds) * ROUND_S)
    assert max(binomial.whole.values()) < max(tree.whole.values())
    assert binomial.pipelines == tree.pipelines == ()


def test_ssd_or_host_memory_where_no_server_holds_it_or_the_system_does_not_multicast():
    for system, holders in (("serverlessllm", [0]), ("lambdascale", [])):
        start = start_plan(SYSTEMS[system], FABRIC, MODEL, holders, [1, 2, 3], cached={2})
        assert start.whole == pytest.approx({1: MODEL.bytes / FABRIC.ssd_bytes_s, 2: MODEL.bytes / FABRIC.host_bytes_s,
                                             3: MODEL.bytes / FABRIC.ssd_bytes_s})
        assert start.pipelines == ()
    assert start_plan(SYSTEMS["ideal"], FABRIC, MODEL, [0], [1, 2], set()).whole == {1: 0.0, 2: 0.0}


def test_execute_while_load_answers_before_any_member_holds_the_model():
    """2 -> 8: the sub-groups receive the chunks in different orders (Algorithm 1), so a pipeline
    with a server from each holds every block after about b/2 rounds (Algorithm 2)."""
    start = start_plan(SYSTEMS["lambdascale"], FABRIC, MODEL, [0, 1], list(range(2, 8)), set())
    groups = plan(["0", "1"], names(range(2, 8)), FABRIC.blocks).groups
    assert start.pipelines
    for members, answers in start.pipelines:
        assert answers < min(start.whole[m] for m in members)
        assert answers <= (FABRIC.blocks // 2 + 3) * ROUND_S
        assert {next(i for i, g in enumerate(groups) if str(m) in g) for m in members} == {0, 1}
    assert start_plan(SYSTEMS["multicast"], FABRIC, MODEL, [0, 1], list(range(2, 8)), set()).whole == start.whole


def served(result, jobs):
    """Every job answered once, and every token made exactly once over its runs."""
    assert len(result.ttft) == len(result.done) == len(jobs)
    assert sum(tokens for _, _, tokens in result.runs) == sum(j.tokens for j in jobs)
    assert min(result.ttft) > 0


@pytest.mark.parametrize("warm", [1, 2, 4])
def test_a_switch_to_local_execution_loses_and_repeats_no_token(warm):
    jobs = burst(600, prompt=512, tokens=64)
    result = simulate("lambdascale", MODEL, jobs, Fabric(servers=8), warm=warm, scale_to=8)
    assert result.starts["pipeline"] >= 1
    served(result, jobs)
    # the pipelines' requests were still running when their members became whole
    switched = [first for first, last, tokens in result.runs if tokens < 64]
    assert switched


def test_new_slots_answer_in_the_order_the_transfers_allow():
    full = {name: simulate(name, MODEL, [], Fabric(servers=8), warm=2, scale_to=8).capacity_at(8 * FABRIC.batch)
            for name in ("lambdascale", "multicast", "faasnet", "serverlessllm")}
    assert full["lambdascale"] < full["multicast"] < full["faasnet"] < full["serverlessllm"]
    assert full["serverlessllm"] == pytest.approx(MODEL.bytes / FABRIC.ssd_bytes_s)


def test_throughput_bins_hold_every_token():
    jobs = burst(300, tokens=40)
    result = simulate("lambdascale", MODEL, jobs, Fabric(servers=8), warm=2, scale_to=8)
    step = 0.05
    tps = result.throughput(max(result.done) + 1, step)
    assert tps.sum() * step == pytest.approx(sum(j.tokens for j in jobs))
    assert tps.max() <= 8 * FABRIC.batch / MODEL.tpot_s * 1.01


def test_the_autoscaling_rule():
    assert servers_wanted(0, 32, 12, 1) == 1
    assert servers_wanted(33, 32, 12, 1) == 2
    assert servers_wanted(10_000, 32, 12, 1) == 12


@pytest.mark.parametrize("system", sorted(SYSTEMS))
def test_a_bursty_trace_is_served_within_the_cluster(system):
    jobs = burstgpt_like(10.0, 300.0, seed=3)
    result = simulate(system, MODEL, jobs)
    served(result, jobs)
    assert max(slots for _, slots in result.capacity) <= FABRIC.servers * FABRIC.batch
    assert result.starts["local"] + result.starts["pipeline"] >= 2  # the bursts made it scale out
    assert np.percentile(simulate("ideal", MODEL, jobs).ttft, 90) <= np.percentile(result.ttft, 90) + 1e-9


def test_slower_starts_answer_later_on_the_same_trace():
    jobs = burstgpt_like(10.0, 600.0, seed=4)
    p99 = {name: float(np.percentile(simulate(name, MODEL, jobs).ttft, 99)) for name in ("lambdascale", "serverlessllm")}
    assert p99["lambdascale"] < p99["serverlessllm"]


def test_lengths_are_heavy_tailed_and_bounded():
    jobs = jobs_at(np.arange(5000) * 0.01, seed=0)
    outputs = np.array([j.tokens for j in jobs])
    assert 16 <= outputs.min() and outputs.max() <= 8 * 250
    assert np.mean(outputs) == pytest.approx(250, rel=0.15)
    assert np.percentile(outputs, 99) > 3 * np.median(outputs)
    assert all(isinstance(j, Job) and math.isfinite(j.at) for j in jobs)
