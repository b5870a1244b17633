"""The cluster simulator: queueing against closed forms, determinism, conservation, the start
paths, and the live system's policy objects driven unmodified."""
from __future__ import annotations

import heapq

import numpy as np
import pytest

from autoscaler.policy.baselines import BASELINES
from autoscaler.policy.controller import make_policy
from autoscaler.policy.queueing import mmc_wait
from contracts.config import Settings, load_settings
from keysmanager.cache_policy import Held, OverBudget, evictions
from loadgen.arrivals import gamma_arrivals, poisson_arrivals
from loadgen.metrics import summarize
from models.profiles import Profile
from sim.config import SimConfig, embedded_runtime, quart_testbed
from sim.models import SimModel, table1
from sim.run import report_run, simulate, stage_timeline
from sim.simulation import Simulation
from state.records import CONSOLIDATING, PIPELINED, SPLITTING, WHOLE

BARE = SimConfig(servers=1, gpus_per_server=16, hop_s=0.0, entry_s=0.0, hop_bandwidth=0.0, tail_s=0.0,
                 window_s=10.0, request_timeout_s=1e9)


def one_stage(mean_ms: float, cv: float = 1.0) -> SimModel:
    return SimModel("q", Profile("q", mean_ms, cv=cv, weights=(1.0,)), 0)


def finish_starts(sim: Simulation) -> dict[str, float]:
    """Runs only the start paths' events; returns when each started replica became ready."""
    ready: dict[str, float] = {}
    sim.cluster._start_serving = lambda r, now: ready.setdefault(r.id, now)
    while sim._heap:
        t, _, kind, x, y = heapq.heappop(sim._heap)
        if kind == "fluid":
            sim.cluster.on_fluid(x, y, t)
        elif kind == "started":
            sim.cluster.on_started(x, t)
        elif kind == "received":
            sim.cluster.on_received(x, t)
    return ready


def static(replicas: int, home) -> Settings:
    return load_settings(environ={}, home=str(home), policy_params={"replicas": replicas})


@pytest.mark.parametrize("servers,rho", [(1, 0.7), (3, 0.8)])
def test_mean_wait_matches_mmc(tmp_path, servers, rho):
    mu = 10.0
    lam = rho * servers * mu
    arrivals = {"q": poisson_arrivals(lam, 200_000 / lam, seed=servers)}
    trace = simulate(BARE.replace(seed=servers), [one_stage(1000 / mu)], arrivals, "static", static(servers, tmp_path),
                     record_arrivals=False)
    warm = trace.sent > 100.0        # skip the start, when the queue is still empty
    measured = float(np.mean(trace.wait[warm, 0]))
    assert measured == pytest.approx(mmc_wait(lam, mu, servers), rel=0.05)
    assert float(np.mean(trace.service[:, 0])) == pytest.approx(1 / mu, rel=0.02)


def test_a_seed_gives_the_same_run_and_another_seed_another(tmp_path):
    models = table1(["llama-7b", "bert-21b"])
    arrivals = {m.name: gamma_arrivals(6.0, 4.0, 40.0, seed=k) for k, m in enumerate(models)}
    cfg = quart_testbed(seed=3, tail_s=5.0)
    settings = load_settings(environ={}, home=str(tmp_path))
    a = simulate(cfg, models, arrivals, "quart", settings)
    b = simulate(cfg, models, arrivals, "quart", settings)
    c = simulate(cfg.replace(seed=4), models, arrivals, "quart", settings)
    assert np.array_equal(a.latency, b.latency) and np.array_equal(a.status, b.status)
    assert a.samples == b.samples and a.starts == b.starts
    assert not np.array_equal(a.latency, c.latency)


def test_every_request_is_answered_or_counted_as_failed(tmp_path):
    """Overload with a short timeout: some requests fail, none is lost."""
    cfg = embedded_runtime(request_timeout_s=2.0, tail_s=1.0)
    arrivals = {"llama-7b": gamma_arrivals(40.0, 4.0, 20.0, seed=1)}
    trace = simulate(cfg, table1(["llama-7b"]), arrivals, "static", load_settings(environ={}, home=str(tmp_path)))
    ok, failed = int((trace.status == 200).sum()), int(np.isin(trace.status, (429, 504)).sum())
    assert ok + failed == len(arrivals["llama-7b"]) and failed > 0 and ok > 0
    assert np.all(trace.latency[trace.status == 200] <= 2.0)
    s = summarize(trace.records(), 0.3, 20.0)
    assert s["sent"] == len(arrivals["llama-7b"]) and s["ok"] + s["failed"] == s["sent"]


@pytest.mark.parametrize("policy", ["quart", *sorted(BASELINES)])
def test_the_live_policy_objects_run_unmodified(tmp_path, policy):
    settings = load_settings(environ={}, home=str(tmp_path))
    arrivals = {"llama-7b": gamma_arrivals(20.0, 4.0, 30.0, seed=4)}
    sim = Simulation(embedded_runtime(), table1(["llama-7b"]), arrivals, policy, settings)
    live = make_policy(settings.replace(policy=policy, tick_s=sim.cfg.tick_s), "llama-7b")
    assert sim.controller.policies["llama-7b"] == live     # the very object the live loop builds
    trace = sim.run()
    assert trace.decisions >= 30
    # Every request is answered: served, or refused at the entry as the runtime's admission does.
    answered = int((trace.status == 200).sum())
    assert answered + int((trace.status == 429).sum()) == len(arrivals["llama-7b"]) and answered > 0
    run = report_run(trace, sim.cfg, sim.models)
    assert run["summary"]["ok"] == answered and len(run["timeline"]["cv"]) == 8


def test_the_embedded_entry_refuses_what_would_queue_past_the_admission_bound(tmp_path):
    """The embedded preset runs the runtime's admission control: an overload is refused (429) at
    the entry, so what is admitted does not wait much past QUART_ADMIT_WAIT_S; without it, all
    is admitted and queues."""
    arrivals = {"llama-7b": gamma_arrivals(60.0, 1.0, 20.0, seed=2)}
    settings = load_settings(environ={}, home=str(tmp_path), policy_params={"replicas": 1})
    limited = simulate(embedded_runtime(), table1(["llama-7b"]), arrivals, "static", settings)
    unlimited = simulate(embedded_runtime(admission=False), table1(["llama-7b"]), arrivals, "static", settings)
    assert (limited.status == 429).sum() > 0 and not (unlimited.status == 429).any()
    assert np.nanmax(limited.latency[limited.status == 200]) < np.nanmax(unlimited.latency[unlimited.status == 200])


def test_a_burst_makes_a_key_stage_that_is_forked_up_on_the_testbed(tmp_path):
    """QUART on 12 servers: the heaviest stage becomes key, the KeysManagers cache it, and its
    later replicas are forks; cold starts take seconds, forks milliseconds."""
    arrivals = {"llama-7b": gamma_arrivals(12.0, 4.0, 120.0, seed=2)}
    sim = Simulation(quart_testbed(tail_s=5.0), table1(["llama-7b"]), arrivals, "quart", load_settings(environ={}, home=str(tmp_path)))
    trace = sim.run()
    assert trace.starts["fork"] > 0
    assert max(max(row) for row in trace.samples["llama-7b"]["replicas"]) > 1
    assert any("llama-7b:" in k for sv in sim.cluster.servers for k in sv.zygotes)
    assert int((trace.status == 200).sum()) == len(arrivals["llama-7b"])


def test_without_the_fork_cache_every_scale_up_starts_cold(tmp_path):
    """QUART_ABLATE=fork-cache: the same burst as above, but no KeysManager caches the key stage."""
    arrivals = {"llama-7b": gamma_arrivals(12.0, 4.0, 120.0, seed=2)}
    settings = load_settings(environ={"QUART_ABLATE": "fork-cache"}, home=str(tmp_path))
    sim = Simulation(quart_testbed(tail_s=5.0), table1(["llama-7b"]), arrivals, "quart", settings)
    trace = sim.run()
    assert trace.starts["fork"] == 0 and trace.starts["cold"] > 0
    assert not any(sv.zygotes for sv in sim.cluster.servers)


def test_the_flow_variant_sizes_the_stages_behind_a_burst_before_it_reaches_them(tmp_path):
    """quart-flow against the paper's QUART on the same bursty trace: the stages after the
    first carry more replicas sooner, so the burst waits less there."""
    arrivals = {"llama-7b": gamma_arrivals(10.0, 8.0, 120.0, seed=3)}
    waits = {}
    for policy in ("quart", "quart-flow"):
        trace = simulate(quart_testbed(tail_s=5.0, slo_x=2.0), table1(["llama-7b"]), arrivals, policy,
                         load_settings(environ={}, home=str(tmp_path)), record_arrivals=False)
        assert int((trace.status == 200).sum()) == len(arrivals["llama-7b"])
        waits[policy] = float(np.nansum(np.nanmean(trace.wait[:, 1:], axis=0)))
    assert waits["quart-flow"] < waits["quart"], waits


def test_a_fan_out_fan_in_pipeline_joins_every_requests_parts_once(tmp_path):
    """The ensemble DAG: stage 0 feeds three branches that stage 7 joins. Alone, a request takes
    its critical path (the heaviest branch); under load every request is answered once, each
    stage saw every request once, and the join starts a request only after its last part."""
    model = table1(["ensemble-8"])[0]
    assert model.critical_path() == [0, 1, 4, 7]
    alone = simulate(BARE.replace(servers=4), [model], {model.name: np.array([1.0])}, "static", static(1, tmp_path))
    path_s = sum(model.profile.stage_ms(i) for i in (0, 1, 4, 7)) / 1000.0
    assert alone.status[0] == 200 and alone.latency[0] == pytest.approx(path_s, rel=0.6)
    arrivals = {model.name: gamma_arrivals(10.0, 2.0, 60.0, seed=1)}
    trace = simulate(quart_testbed(tail_s=10.0), [model], arrivals, "static", static(2, tmp_path))
    n = len(arrivals[model.name])
    assert int((trace.status == 200).sum()) == n
    assert [len(a) for a in trace.stage_arrivals[model.name]] == [n] * 8
    assert not np.isnan(trace.service[:, :8]).any()    # every stage served every request


def test_cold_starts_share_a_servers_bandwidth(tmp_path):
    cfg = BARE.replace(servers=1, bandwidth=1e9, init_s=1.0)
    model = SimModel("q", Profile("q", 100, weights=(1.0,), size_gb=2.0), 0)
    sim = Simulation(cfg, [model], {"q": np.array([1.0])}, "static", static(1, tmp_path))
    stage = sim.stages["q:0"]
    server = sim.cluster.servers[0]
    a = sim.cluster.start(stage, server, "cold", 0.0)
    b = sim.cluster.start(stage, server, "cold", 0.0)
    ready = finish_starts(sim)
    # Two 2 GB reads sharing 1 GB/s end together after 4 s, then 1 s of initialisation.
    assert ready[a.id] == pytest.approx(5.0) and ready[b.id] == pytest.approx(5.0)


def test_with_a_model_store_cold_reads_share_its_link_and_peers_send_at_their_own(tmp_path):
    """Two servers reading a 2 GB stage from a 1 GB/s store end together after 4 s (their own links
    are far faster); a peer start's stage arrives when the scheduler predicted, then initialises."""
    cfg = BARE.replace(servers=3, bandwidth=1e10, store_bandwidth=1e9, init_s=1.0)
    model = SimModel("q", Profile("q", 100, weights=(1.0,), size_gb=2.0), 0)
    sim = Simulation(cfg, [model], {"q": np.array([1.0])}, "static", static(1, tmp_path))
    stage, servers = sim.stages["q:0"], sim.cluster.servers
    a, b = (sim.cluster.start(stage, sv, "cold", 0.0) for sv in servers[:2])
    c = sim.cluster.start(stage, servers[2], "peer", 0.0, arrival_s=0.5)
    ready = finish_starts(sim)
    assert ready[a.id] == pytest.approx(5.0) and ready[b.id] == pytest.approx(5.0)
    assert ready[c.id] == pytest.approx(1.5)
    assert sim.cluster.starts == {"fork": 0, "cold": 2, "peer": 1}


def test_a_burst_on_servers_behind_a_slow_store_scales_the_key_stage_out_from_its_holders(tmp_path):
    """QUART on the testbed behind a store slower than the servers' links: once the key stage is
    cached, replicas placed where it is not receive it from the servers that cache it; with
    peer-start ablated, the same burst reads the store every time."""
    arrivals = {"llama-7b": gamma_arrivals(12.0, 4.0, 120.0, seed=2)}
    cfg = quart_testbed(tail_s=5.0, store_bandwidth=1.25e9, bandwidth=1.25e10)
    starts = {}
    for ablate in ("", "peer-start"):
        settings = load_settings(environ={"QUART_ABLATE": ablate}, home=str(tmp_path))
        trace = Simulation(cfg, table1(["llama-7b"]), arrivals, "quart", settings).run()
        assert int((trace.status == 200).sum()) == len(arrivals["llama-7b"])
        starts[ablate] = trace.starts
    assert starts[""]["peer"] > 0, starts
    assert starts["peer-start"]["peer"] == 0 and starts["peer-start"]["cold"] > 0, starts


def test_initialisations_share_the_hosts_cores(tmp_path):
    """Where cores are modelled, four 1 s initialisations on 2 cores all end after 2 s."""
    cfg = BARE.replace(servers=1, bandwidth=1e15, init_s=1.0, host_cores=2.0)
    model = SimModel("q", Profile("q", 100, weights=(1.0,)), 0)
    sim = Simulation(cfg, [model], {"q": np.array([1.0])}, "static", static(1, tmp_path))
    started = [sim.cluster.start(sim.stages["q:0"], sim.cluster.servers[0], "cold", 0.0) for _ in range(4)]
    assert sim.cluster.servers[0].slowdown() == 1.0      # reads first; nothing initialises yet
    ready = finish_starts(sim)
    assert [ready[r.id] for r in started] == pytest.approx([2.0] * 4, abs=1e-6)


def test_stage_cvs_fall_behind_a_busy_stage(tmp_path):
    """QUART Fig. 2a's effect: a busy stage smooths a bursty stream for the stages after it (the
    even split at 85 % utilisation: the first stage does most of it)."""
    arrivals = {"llama-7b": gamma_arrivals(28.0, 4.0, 200.0, seed=5)}
    trace = simulate(embedded_runtime(), table1(["llama-7b"]), arrivals, "static", load_settings(environ={}, home=str(tmp_path)))
    cvs = stage_timeline(trace, embedded_runtime(), table1(["llama-7b"])[0])["cv"]
    assert cvs[0] > 3.0 and cvs[-1] < 0.5 * cvs[0]


def test_cache_policy_evicts_least_recently_used_idle_zygotes_and_refuses_early():
    held = [Held("m:0", 4, 1.0), Held("m:1", 4, 0.5), Held("m:2", 4, 0.1, forking=True), Held("m:3", 4, 0.2)]
    assert evictions(held, {"m:3"}, 16, 4) == ["m:1"]
    assert evictions(held, {"m:3"}, 16, 8) == ["m:1", "m:0"]
    assert evictions(held, set(), 0, 100) == []
    # A zygote cached moments ago is not evicted for another key stage (QUART_CACHE_MIN_RESIDENCY_S).
    fresh = [Held("m:0", 4, 9.0, cached_at=9.0), Held("m:1", 4, 5.0, cached_at=-30.0)]
    assert evictions(fresh, set(), 8, 4, now=10.0, min_residency_s=30.0) == ["m:1"]
    with pytest.raises(OverBudget):
        evictions(fresh, set(), 8, 8, now=10.0, min_residency_s=30.0)
    assert evictions(fresh, set(), 8, 8, now=40.0, min_residency_s=30.0) == ["m:1", "m:0"]
    with pytest.raises(OverBudget):
        evictions(held, {"m:0", "m:1", "m:3"}, 16, 4)


def test_the_command_line_sets_a_boolean_field_by_its_name():
    from sim.__main__ import config, parse
    assert config(parse(["--preset", "embedded", "--set", "admission=false"])).admission is False
    assert config(parse(["--preset", "embedded"])).admission is True
    with pytest.raises(SystemExit, match="takes a bool"):
        config(parse(["--set", "admission=nope"]))


def test_the_embedded_runtime_starts_with_four_stages_cached_and_four_warming(tmp_path):
    """As `make up` reports when a replay begins: the cached stages' zygotes took their cores
    before the run; only the four warming ones share the cores in it (5.1 s of one core's work
    each), and all eight are cached by its end. Static starts no replica."""
    sim = Simulation(embedded_runtime(), table1(["llama-7b"]), {"llama-7b": np.array([60.0])}, "static",
                     load_settings(environ={}, home=str(tmp_path)))
    sim.run()
    server = sim.cluster.servers[0]
    assert len(server.zygotes) == 8 and all(z.ready for z in server.zygotes.values())
    assert server.cpu.used == pytest.approx(4 * sim.cfg.init_s, rel=0.01)


def test_the_data_planes_cpu_shares_the_embedded_runtimes_cores(tmp_path):
    """Every hop's CPU part and every request's CPU outside the stages take core time (measured by
    the data_plane_cpu benchmark); a burst whose hand-offs outrun the two cores waits for them."""
    settings = load_settings(environ={}, home=str(tmp_path))
    steady = embedded_runtime(admission=False, cache_at_start="all")
    arrivals = np.linspace(1.0, 6.0, 50)
    sim = Simulation(steady, table1(["llama-7b"]), {"llama-7b": arrivals}, "static", settings)
    sim.run()
    work = len(arrivals) * (8 * steady.item_cpu_s + steady.request_cpu_s)
    assert sim.cluster.servers[0].cpu.used == pytest.approx(work, rel=0.01)
    # 200 requests at once, a replica for each at every stage: the stages take them all at once,
    # and their hand-offs queue for the cores.
    burst = {"llama-7b": np.full(200, 1.0)}
    wide = steady.replace(initial_replicas=200, gpus_per_server=2000)
    shared = simulate(wide, table1(["llama-7b"]), burst, "static", settings)
    free = simulate(wide.replace(item_cpu_s=0.0, request_cpu_s=0.0), table1(["llama-7b"]), burst, "static", settings)
    assert shared.latency.mean() > free.latency.mean() + 0.25


@pytest.mark.parametrize("policy", ["quart", "static"])
def test_idle_stages_sleep_at_zero_and_the_next_request_wakes_them_all(tmp_path, policy):
    """Scale to zero in the simulator, decided by the same Controller as live: a model idle for
    its zero-duration has every stage at zero until the next request, which wakes them all at once
    (the gateway's scale from zero) and waits for their start; every request is answered."""
    first = poisson_arrivals(2.0, 20.0, seed=3)
    arrivals = {"llama-7b": np.concatenate([first, first + 80.0])}
    cfg = quart_testbed(tail_s=5.0, idle_s=15.0)
    sim = Simulation(cfg, table1(["llama-7b"]), arrivals, policy, load_settings(environ={}, home=str(tmp_path)))
    trace = sim.run()
    t = np.array(trace.samples["llama-7b"]["t"])
    replicas = np.array(trace.samples["llama-7b"]["replicas"])
    gap = (t > 20.0 + 15.0 + 2.0) & (t < 80.0)
    assert gap.any() and (replicas[gap] == 0).all()                 # every stage asleep in the gap
    assert (replicas[(t > 5.0) & (t < 20.0)] >= 1).all()            # awake while requests come
    assert int((trace.status == 200).sum()) == len(arrivals["llama-7b"])
    woken = int(np.searchsorted(arrivals["llama-7b"], 80.0))
    warm = np.median(trace.latency[:len(first)])
    assert trace.latency[woken] > warm + cfg.init_s / 2              # the first after the gap waited for a start


def test_without_a_zero_duration_nothing_sleeps(tmp_path):
    first = poisson_arrivals(2.0, 20.0, seed=3)
    arrivals = {"llama-7b": np.concatenate([first, first + 80.0])}
    trace = Simulation(quart_testbed(tail_s=5.0), table1(["llama-7b"]), arrivals, "static",
                       static(1, tmp_path)).run()
    assert (np.array(trace.samples["llama-7b"]["replicas"]) >= 1).all()


def test_a_quiet_model_consolidates_and_a_burst_splits_it(tmp_path):
    """Consolidation in the simulator, decided by the same Controller's layout rule as live: a
    quiet model consolidates into one whole replica and its stages go to zero; a burst beyond what
    one whole replica takes brings the stages back and the whole replica goes; every request is
    answered."""
    quiet = poisson_arrivals(0.5, 60.0, seed=4)
    burst = 60.0 + np.sort(np.random.default_rng(5).uniform(0.0, 5.0, 200))
    arrivals = {"llama-7b": np.concatenate([quiet, burst])}
    settings = load_settings(environ={"QUART_LAYOUT_WINDOW_S": "5", "QUART_LAYOUT_WINDOWS": "3",
                                      "QUART_MAX_BATCH": "4"}, home=str(tmp_path))
    sim = Simulation(quart_testbed(tail_s=60.0, whole_max=1), table1(["llama-7b"]), arrivals, "quart", settings)
    trace = sim.run()
    changes = sim.cluster.layout_changes
    assert [layout for _, _, layout, _ in changes[:4]] == [CONSOLIDATING, WHOLE, SPLITTING, PIPELINED]
    (_, whole_at, split_at, back_at) = [at for at, _, _, _ in changes[:4]]
    assert whole_at < 60.0 <= split_at                                                # split by the burst
    t = np.array(trace.samples["llama-7b"]["t"])
    whole = np.array(trace.samples["llama-7b"]["whole"])
    stages = np.array(trace.samples["llama-7b"]["replicas"])
    calm = (t > whole_at + 5.0) & (t < 60.0)
    assert calm.any() and (whole[calm] == 1).all() and (stages[calm] == 0).all()   # served whole, stages at zero
    after = (t > back_at) & (t < (changes[4][0] if len(changes) > 4 else np.inf))
    assert after.any() and (whole[after] == 0).all() and (stages[after] >= 1).all()  # pipelined again
    assert int((trace.status == 200).sum()) == len(arrivals["llama-7b"])
