"""The simulator's generative data plane: a request alone costs what its steps cost; steps batch
under the live replica's rule; caches stay within each replica's budget (429 past the wait, 413
when one can never fit); a replica removed mid-generation migrates or finishes its sequences
and no request is lost; the step-cost fit and the shipped calibration."""
from __future__ import annotations

import json

import numpy as np
import pytest

from contracts.config import load_settings
from engine.batch_policy import GATHER, MIGRATE, PREFILL_EVERY, batch_limit, handover_peer, migration_peer, new_item_slots, still_fed
from models.decode_batches import FEW_ROWS
from sim.config import SimConfig, embedded_runtime
from sim.models import GenerativeModel, resolve
from sim.run import report_run, unloaded_generation
from sim.simulation import Simulation
from sim.step_cost import Calibration, StepCost, calibrated, features

BARE = SimConfig(servers=1, gpus_per_server=16, hop_s=0.001, entry_s=0.002, hop_bandwidth=0.0, tail_s=0.0,
                 request_timeout_s=1e9, cache_at_start="none")
# 10 ms a batch, 1 ms a token, 2 ms a request, nothing for attention.
COST = StepCost((0.010, 0.001, 0.002, 0.0))


def model(stages: int = 2, new: int = 8, kv: int = 1000) -> GenerativeModel:
    cal = Calibration("gen", (COST,) * stages, (kv,) * stages, 64, (1000,) * stages, (20,), {})
    return GenerativeModel("gen", cal, new)


def run(m: GenerativeModel, arrivals, prompts=None, replicas: int = 1, cfg: SimConfig = BARE,
        sim_class=Simulation, **batching):
    settings = load_settings(environ={}, policy_params={"replicas": replicas})
    settings = settings.replace(**batching) if batching else settings
    sim = sim_class(cfg.replace(initial_replicas=replicas), [m], {m.name: np.asarray(arrivals, dtype=float)},
                    "static", settings, prompts={m.name: prompts} if prompts else None)
    return sim, sim.run()


def test_a_request_alone_costs_its_steps_hops_and_entry():
    m = model(stages=2, new=8)
    _, trace = run(m, [0.0], [20])
    g = trace.generation
    prefill = COST.batch_s([(20, 0)])
    decode = COST.batch_s([(1, 25)])
    ttft = BARE.entry_s + 2 * (prefill + BARE.hop_s)           # in and out of the entry once each
    tpot = BARE.entry_s / 2 + 2 * (decode + BARE.hop_s) + BARE.hop_s   # back to stage 0, the stages, the entry
    assert trace.status.tolist() == [200]
    assert g.tokens.tolist() == [8]
    assert g.ttft[0] == pytest.approx(ttft, rel=1e-6)
    assert g.tpot[0] == pytest.approx(tpot, rel=1e-6)
    assert trace.latency[0] == pytest.approx(g.ttft[0] + 7 * g.tpot[0], rel=1e-6)
    assert dict(g.batches["gen:0"]) == {1: 8}     # one prefill, seven decode steps


def test_concurrent_requests_batch_within_the_bound_and_raise_throughput():
    m = model(stages=3, new=32)
    _, alone = run(m, [0.0], [20])
    _, many = run(m, np.zeros(16), [20] * 16, max_batch=8)
    sizes = [size for key in many.generation.batches for size in many.generation.batches[key]]
    assert (many.status == 200).all() and (many.generation.tokens == 32).all()
    assert max(sizes) <= 8 + 1          # a forced prefill may join a full batch (PREFILL_EVERY)
    assert max(sizes) > 1
    tps = lambda t: t.generation.tokens.sum() / np.nanmax(t.latency)   # noqa: E731
    assert tps(many) > 4 * tps(alone)
    assert np.median(many.generation.tpot) > alone.generation.tpot[0]   # a bigger batch is a longer step


def test_a_stage_priced_compiled_batches_at_most_a_few_steps_as_the_replica_does():
    assert batch_limit(16, FEW_ROWS) == FEW_ROWS and batch_limit(4, FEW_ROWS) == 4 and batch_limit(16, None) == 16
    compiled = StepCost(COST.coefficients, (0.004, 0.001, 0.0, 0.0, 0.002, 0.004))
    eager, fast = model(stages=2, new=16), GenerativeModel("gen", Calibration(
        "gen", (compiled,) * 2, (1000,) * 2, 64, (1000,) * 2, (20,), {}), 16)
    sizes = {}
    for name, m in (("eager", eager), ("compiled", fast)):
        _, trace = run(m, np.zeros(16), [20] * 16, max_batch=16)
        assert (trace.status == 200).all() and (trace.generation.tokens == 16).all()
        sizes[name] = max(size for key in trace.generation.batches for size in trace.generation.batches[key])
    assert sizes["eager"] > FEW_ROWS and sizes["compiled"] == FEW_ROWS, sizes


def test_max_batch_one_runs_every_step_alone():
    _, trace = run(model(new=4), np.zeros(4), [10] * 4, max_batch=1)
    assert all(set(c) <= {1, 2} for c in trace.generation.batches.values())   # 2: a forced prefill
    assert (trace.status == 200).all()


def test_prefills_spread_over_replicas_and_decodes_stay_with_the_holder():
    m = model(stages=2, new=6)
    sim, trace = run(m, np.linspace(0, 0.05, 12), [10] * 12, replicas=3)
    assert (trace.status == 200).all()
    peaks = trace.generation.kv_peak
    assert set(peaks) == {"gen:0", "gen:1"}
    # Every replica took prefills, and no sequence moved (only drains move them).
    assert trace.generation.migrations == 0
    assert all(r.kv_used == 0 and not r.held for st in sim.stages.values() for r in st.replicas)


def test_kv_budget_holds_and_overflow_gets_429_after_the_wait():
    m = model(stages=2, new=40, kv=1000)
    need = (10 + 40) * 1000                  # capacity positions x bytes per position
    _, trace = run(m, np.zeros(8), [10] * 8, kv_bytes=2 * need, kv_wait_s=0.05)
    statuses = trace.status.tolist()
    assert statuses.count(429) > 0 and statuses.count(200) >= 2
    assert all(peak <= 2 * need for peak in trace.generation.kv_peak.values())
    records = trace.records()
    assert all(r.ttft_s >= 0 for r in records if r.ok) and all(r.ttft_s < 0 for r in records if not r.ok)


def test_waiting_prefills_run_when_room_is_freed():
    m = model(stages=2, new=8, kv=1000)
    need = (10 + 8) * 1000
    _, trace = run(m, np.zeros(6), [10] * 6, kv_bytes=2 * need, kv_wait_s=60.0)
    assert (trace.status == 200).all()
    assert all(peak <= 2 * need for peak in trace.generation.kv_peak.values())


def test_a_cache_that_can_never_fit_is_413():
    _, trace = run(model(new=8, kv=1000), [0.0], [10], kv_bytes=1000)
    assert trace.status.tolist() == [413]


class ScaleDown(Simulation):
    """Two replicas per stage, one removed from each at 0.5 s while every request generates."""
    def _tick(self, now: float) -> None:
        if now >= 0.5:
            for st in self.stages.values():
                st.desired = 1
        self.cluster.converge(now)


@pytest.mark.parametrize("drain", ["migrate", "finish"])
def test_scale_down_mid_generation_loses_no_request(drain):
    m = model(stages=2, new=100)
    cfg = BARE.replace(tick_s=0.25)
    sim, trace = run(m, np.zeros(8), [10] * 8, replicas=2, cfg=cfg, sim_class=ScaleDown, drain=drain)
    assert (trace.status == 200).all() and (trace.generation.tokens == 100).all()
    assert all(len(st.replicas) == 1 for st in sim.stages.values())
    assert (trace.generation.migrations > 0) == (drain == "migrate")
    assert all(not r.held and r.kv_used == 0 for st in sim.stages.values() for r in st.replicas)


def test_same_seed_same_run():
    m = model(stages=2, new=16)
    arrivals = np.sort(np.random.default_rng(3).uniform(0, 2, 30))
    a = run(m, arrivals)[1]
    b = run(m, arrivals)[1]
    assert np.array_equal(a.latency, b.latency) and np.array_equal(a.generation.prompt, b.generation.prompt)


def test_report_has_token_metrics():
    m = model(stages=2, new=16)
    cfg = BARE
    _, trace = run(m, np.linspace(0, 1, 10))
    summary = report_run(trace, cfg, [m])["summary"]
    ttft, tpot = unloaded_generation(cfg, m)
    tokens = summary["tokens"]
    assert tokens["ttft_slo_s"] == pytest.approx(5 * ttft) and tokens["tpot_slo_s"] == pytest.approx(2 * tpot)
    assert tokens["ttft_attainment"] == 1.0 and tokens["token_goodput_per_s"] > 0


def test_batch_policy_never_starves_prefills():
    assert new_item_slots(16, 4, 0) == 12
    assert new_item_slots(16, 16, PREFILL_EVERY - 1) == 0
    assert new_item_slots(16, 16, PREFILL_EVERY) == 1
    assert migration_peer({"a": 3, "b": 1, "c": 1}) == "b"
    assert migration_peer({}) is None


def test_a_draining_replica_hands_over_to_a_wider_peer_first_then_same_then_narrower():
    assert handover_peer(1, {"same": (1, 0), "busy": (4, 9), "idle": (4, 2), "narrow": (0, 0)}) == ("idle", GATHER)
    assert handover_peer(1, {"same": (1, 3), "other": (1, 2)}) == ("other", MIGRATE)
    assert handover_peer(4, {"a": (1, 5), "b": (2, 1)}) == ("b", MIGRATE)
    assert handover_peer(4, {}) is None


def test_a_draining_replica_reads_on_while_only_it_can_take_what_an_earlier_stage_sends():
    assert still_fed(readers=0, upstream=1, unread=0)      # stage 0 may still forward a prefill
    assert still_fed(readers=0, upstream=0, unread=2)      # items already forwarded wait unread
    assert not still_fed(readers=1, upstream=1, unread=2)  # a replica that stays reads them
    assert not still_fed(readers=0, upstream=0, unread=0)  # nothing can arrive: it may leave


def test_step_cost_fit_recovers_known_coefficients():
    truth = StepCost((0.004, 0.0005, 0.001, 0.0002))
    shapes = [[(1, c)] * b for c in (32, 256) for b in (1, 4, 16)] + [[(p, 0)] for p in (16, 128)]
    fitted = StepCost.fit([(s, truth.batch_s(s)) for s in shapes])
    assert fitted.coefficients == pytest.approx(truth.coefficients, rel=1e-6)
    assert features([(1, 9)]) == [1.0, 1.0, 1.0, 0.01]


def test_compiled_decode_batches_are_priced_by_their_own_fit_and_every_other_batch_eagerly(tmp_path):
    eager = StepCost((0.010, 0.001, 0.0, 0.0))
    compiled = lambda s: 0.002 + 0.0005 * len(s) + (0.001 if len(s) > 1 else 0.0)  # noqa: E731 - one sequence has its own graph
    decodes = [[(1, c)] * b for c in (32, 256) for b in (1, 4, 16)]
    others = [[(p, 0)] for p in (16, 128)] + [[(64, 0)] + [(1, 128)] * 7]
    cost = StepCost.fit([(s, eager.batch_s(s)) for s in decodes + others], [(s, compiled(s)) for s in decodes])
    assert cost.coefficients == pytest.approx(eager.coefficients, abs=1e-9)
    # A decode's tokens are its requests: the two columns are one, so the prices are compared.
    assert [cost.batch_s(s) for s in decodes] == pytest.approx([compiled(s) for s in decodes])
    assert cost.batch_s([(1, 40)] * 4) == pytest.approx(0.005)
    assert cost.batch_s([(1, 40)]) == pytest.approx(0.0025)
    assert cost.batch_s([(1, 40)] * 3) == cost.batch_s([(1, 40)] * 4)  # run padded to its bucket
    assert cost.batch_s([(1, 40), (16, 0)]) == pytest.approx(0.027)   # a prefill joined: the batch runs eager
    assert cost.batch_s([(1, 0)]) == pytest.approx(0.011)             # a one-token prompt is a prefill
    assert StepCost.fit([(s, eager.batch_s(s)) for s in decodes]).decode is None
    cal = Calibration("gen", (cost, eager), (1, 1), 64, (1, 1), (20,), {})
    cal.save(tmp_path / "gen.json")
    assert Calibration.load(tmp_path / "gen.json") == cal
    body = json.loads((tmp_path / "gen.json").read_text())
    body["decode_stages"][0] = body["decode_stages"][0][:5]           # a file from before the last feature
    (tmp_path / "five.json").write_text(json.dumps(body))
    assert Calibration.load(tmp_path / "five.json").stages[0].batch_s([(1, 40)] * 4) == pytest.approx(0.005)
    del body["decode_stages"]                                         # a file from before the split
    (tmp_path / "old.json").write_text(json.dumps(body))
    assert [s.decode for s in Calibration.load(tmp_path / "old.json").stages] == [None, None]


def test_the_shipped_calibration_loads_and_runs_on_the_embedded_preset():
    assert "smollm2" in calibrated()
    m = resolve(["smollm2"], new_tokens=8)[0]
    assert m.num_stages == 4 and len(m.calibration.prompt_tokens) > 0
    _, trace = run(m, np.zeros(4), cfg=embedded_runtime(cache_at_start="none", tail_s=0.0))
    assert (trace.status == 200).all() and (trace.generation.tokens == 8).all()
    with pytest.raises(ValueError, match="unknown model"):
        resolve(["no-such-model"])


def test_the_command_line_reports_token_metrics(tmp_path, capsys):
    from sim.__main__ import main
    assert main(["--preset", "embedded", "--model", "smollm2", "--new-tokens", "8", "--arrivals", "poisson",
                 "--rate", "0.5", "--duration", "10", "--policies", "static", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "TTFT p50" in printed and "token goodput" in printed
    assert "TTFT" in (tmp_path / "report.md").read_text()
