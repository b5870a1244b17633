"""The load generator without a server: trace readers on small files written here, the Gamma
generator's rate and CV, prompt lengths, and the metrics on hand-computed cases."""
from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import pytest

from loadgen import arrivals as arr
from loadgen.client import Record
from loadgen.metrics import goodput, latency_summary, slo_attainment, summarize
from loadgen.requests import PromptPool, build


def write_azure(path: Path, rows: list[tuple[str, list[int]]]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(arr.AZURE_HEADER + [str(m) for m in range(1, 1441)])
        for name, counts in rows:
            w.writerow(["owner", "app", name, "http"] + counts + [0] * (1440 - len(counts)))


def test_azure_reader_spreads_each_minute(tmp_path):
    path = tmp_path / "invocations_per_function_md.anon.d01.csv"
    write_azure(path, [("f1", [3, 0, 5]), ("f2", [0] * 10 + [7]), ("idle", [])])
    functions = arr.read_azure(path)
    assert [f.function for f in functions] == ["f1", "f2", "idle"] and functions[0].total == 8
    picked = arr.pick_functions(functions, 2, seed=1)
    assert {f.function for f in picked} == {"f1", "f2"}  # the idle one is never picked
    assert arr.pick_functions(functions, 1, seed=5) == arr.pick_functions(functions, 1, seed=5)
    times = arr.azure_arrivals(functions[0].per_minute, cv=2.0, seed=0, minute_s=6.0)
    # 3 arrivals in the first (compressed) minute, none in the second, 5 in the third.
    assert np.histogram(times, [0, 6, 12, 18])[0].tolist() == [3, 0, 5]
    assert (np.diff(times) >= 0).all()
    doubled = arr.azure_arrivals(functions[0].per_minute, cv=2.0, seed=0, scale=2.0)
    assert len(doubled) == 16
    window = arr.azure_arrivals(functions[1].per_minute, 1.0, 0, minute_s=60, start_minute=10, minutes=1)
    assert len(window) == 7 and window.max() < 60


def test_azure_reader_refuses_other_files(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b,c\n1,2,3\n")
    with pytest.raises(arr.TraceError, match="not an Azure"):
        arr.read_azure(bad)
    short = tmp_path / "short.csv"
    write_azure(short, [("f", [1])])
    short.write_text(short.read_text() + "o,a,f,http,1,2\n")
    with pytest.raises(arr.TraceError, match="columns"):
        arr.read_azure(short)


def test_burstgpt_reader(tmp_path):
    path = tmp_path / "BurstGPT_1.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(arr.BURSTGPT_HEADER)
        w.writerows([[100, "ChatGPT", 472, 18, 490, "Conversation log"],
                     [101.5, "GPT-4", 1000, 300, 1300, "Conversation log"],
                     [104, "ChatGPT", 30, 0, 30, "Conversation log"],       # failed: no answer
                     [102, "ChatGPT", 1200, 250, 1450, "API log"]])
    rows = arr.read_burstgpt(path, model="ChatGPT")
    assert [(r.at, r.request_tokens, r.response_tokens) for r in rows] == [(0.0, 472, 18), (2.0, 1200, 250)]
    assert [r.at for r in arr.read_burstgpt(path, time_scale=2.0)] == [0.0, 0.75, 1.0]
    assert len(arr.read_burstgpt(path, log_type="API log")) == 1
    with pytest.raises(arr.TraceError):
        arr.read_azure(path)


@pytest.mark.parametrize("cv", [0.1, 1.0, 2.0, 4.0])
def test_gamma_arrivals_reach_their_rate_and_cv(cv):
    times = arr.gamma_arrivals(rate=50.0, cv=cv, duration_s=20000 / 50.0, seed=3)
    gaps = np.diff(times)
    assert abs(len(times) / 400.0 - 50.0) / 50.0 < 0.05
    assert abs(gaps.std() / gaps.mean() - cv) / cv < 0.05
    assert np.array_equal(times, arr.gamma_arrivals(50.0, cv, 400.0, seed=3))
    poisson = np.diff(arr.poisson_arrivals(50.0, 400.0, seed=4))
    assert abs(poisson.std() / poisson.mean() - 1.0) < 0.05


def test_bursty_arrivals_keep_their_mean_rate_and_come_in_spells():
    """The long-run rate holds; the rate per 10 s swings far more than a Gamma process's of the
    same gaps' CV would (bursts are spells, not independent short gaps); a seed fixes it."""
    times = arr.bursty_arrivals(rate=10.0, duration_s=20000.0, seed=5)
    assert abs(len(times) / 20000.0 - 10.0) < 0.5
    gaps = np.diff(times)
    plain = arr.gamma_arrivals(10.0, gaps.std() / gaps.mean(), 20000.0, seed=5)
    per_window = np.histogram(times, bins=2000, range=(0, 20000))[0]
    plain_window = np.histogram(plain, bins=2000, range=(0, 20000))[0]
    assert per_window.std() > 2 * plain_window.std()
    assert np.array_equal(times, arr.bursty_arrivals(10.0, 20000.0, seed=5))
    assert not np.array_equal(times, arr.bursty_arrivals(10.0, 20000.0, seed=6))


def test_in_burst_marks_the_burst_spells_and_hardly_any_of_a_steady_stream():
    bursty = arr.bursty_arrivals(rate=10.0, duration_s=3000.0, seed=3)
    marked = arr.in_burst(bursty, bursty, rate=10.0)
    assert 0.5 < marked.mean() < 0.8   # 68 % of its requests arrive in bursts
    steady = arr.poisson_arrivals(10.0, 3000.0, seed=3)
    assert arr.in_burst(steady, steady, rate=10.0).mean() < 0.01
    # Times between arrivals are judged by the arrivals around them: a lone time in a gap is calm.
    assert arr.in_burst(np.array([0.0, 0.05, 0.1, 0.15, 10.0]), np.array([0.1, 5.0]), rate=1.0).tolist() == [True, False]


def test_diurnal_arrivals_follow_their_daily_cycle():
    times = arr.diurnal_arrivals(rate=10.0, duration_s=12000.0, seed=2, amplitude=0.6, days=1.0)
    assert abs(len(times) / 12000.0 - 10.0) < 0.3
    quarters = np.histogram(times, bins=4, range=(0, 12000))[0] / 3000.0
    assert quarters[1] > quarters[0] * 2 and quarters[2] > quarters[3] * 2  # trough at the ends, peak mid-run
    assert times.min() >= 0 and times.max() < 12000.0 and np.all(np.diff(times) >= 0)
    with pytest.raises(ValueError):
        arr.diurnal_arrivals(10.0, 100.0, seed=0, amplitude=1.0)


def test_prompt_lengths_follow_the_trace():
    pool = PromptPool(["a" * 40, "b" * 400, "c" * 4000, "d" * 80])
    rng = np.random.default_rng(0)
    assert pool.pick(rng, 1000)[1] >= 100
    requests = build({"smollm2": np.array([0.5, 0.1])}, pool, seed=1, prompt_tokens={"smollm2": np.array([10, 1000])},
                     answer_tokens={"smollm2": np.array([3, 7])})
    assert [r.at for r in requests] == [0.1, 0.5]
    assert requests[0].body["max_new_tokens"] == 7 and requests[0].prompt_tokens >= 100
    emulated = build({"llama-7b": np.array([0.0])}, None, seed=1)
    assert emulated[0].body == {"tokens": 16}
    embed = build({"minilm": np.array([0.0])}, pool, seed=1)
    assert list(embed[0].body) == ["inputs"]


def record(latency: float, ok: bool = True, tokens: int = 10) -> Record:
    return Record(0, "m", 0.0, sent=0.0, latency_s=latency, status=200 if ok else 503, prompt_tokens=tokens,
                  output_tokens=2)


def test_metrics_on_hand_computed_cases():
    records = [record(0.1), record(0.2), record(0.3), record(0.4), record(0.05, ok=False)]
    summary = latency_summary([0.1, 0.2, 0.3, 0.4])
    assert summary["mean"] == pytest.approx(0.25) and summary["p50"] == pytest.approx(0.25)
    assert summary["p90"] == pytest.approx(0.37) and summary["p75"] == pytest.approx(0.325)
    assert slo_attainment(records, 0.25) == pytest.approx(2 / 5)  # the failed one is a miss
    assert slo_attainment(records, 1.0) == pytest.approx(4 / 5)
    g = goodput(records, 0.25, duration_s=2.0)
    assert g == {"requests_per_s": 1.0, "tokens_per_s": 12.0}
    full = summarize(records, profiled_s=0.2, duration_s=2.0, replica_seconds=16.0)
    assert full["sent"] == 5 and full["ok"] == 4 and full["failed"] == 1
    assert full["slo_attainment"]["1"] == pytest.approx(2 / 5) and full["slo_attainment"]["2"] == pytest.approx(4 / 5)
    assert full["goodput"]["requests_per_s"] == pytest.approx(2.0)
    assert math.isnan(latency_summary([])["p99"])




def test_token_metrics_count_each_slo_separately_and_goodput_needs_both():
    from loadgen.metrics import TTFT_SLO_SCALE, summarize

    def gen(ttft: float, tpot: float, tokens: int, status: int = 200) -> Record:
        return Record(0, "m", 0.0, sent=0.0, latency_s=ttft + tpot * tokens, status=status, prompt_tokens=5,
                      output_tokens=tokens, ttft_s=ttft, tpot_s=tpot)
    records = [gen(0.1, 0.05, 10), gen(0.9, 0.05, 10), gen(0.1, 0.5, 10), gen(0.1, 0.05, 10, status=503)]
    s = summarize(records, profiled_s=1.0, duration_s=2.0, warm_ttft_s=0.1, tpot_slo_s=0.1)["tokens"]
    assert s["ttft_slo_s"] == TTFT_SLO_SCALE * 0.1
    assert s["ttft_attainment"] == 2 / 4 and s["tpot_attainment"] == 2 / 4
    assert s["token_goodput_per_s"] == 10 / 2.0
    assert s["ttft_s"]["p50"] == 0.1
    assert "tokens" not in summarize(records, profiled_s=1.0, duration_s=2.0)


def test_compare_takes_one_policys_parameters_as_json():
    import pytest

    from loadgen.__main__ import policy_params
    assert policy_params(['inferline={"plan_rps": 20, "plan_cv": 4}']) == {"inferline": {"plan_rps": 20, "plan_cv": 4}}
    for bad in ("inferline={plan", "inferline=[1]"):
        with pytest.raises(SystemExit, match="--params"):
            policy_params([bad])
