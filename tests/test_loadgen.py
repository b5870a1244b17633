"""The load generator: trace readers on small files written here, the Gamma generator's rate and
CV, the open-loop client against a real local HTTP server (its schedule, Ctrl-C), the metrics on
hand-computed cases, and the comparison command end to end on emulated stages."""
from __future__ import annotations

import csv
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from loadgen import arrivals as arr
from loadgen.client import Record, run
from loadgen.metrics import goodput, latency_summary, slo_attainment, summarize
from loadgen.requests import PromptPool, Request, build
from runtime.ports import free_port

REPO = Path(__file__).resolve().parent.parent


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


ENDPOINT = """
import asyncio, sys
from aiohttp import web
async def answer(request):
    await asyncio.sleep(float(sys.argv[2]))
    return web.json_response({"stages": [{"stage": 0, "queue_ms": 1.0, "service_ms": 2.0}], "token_ids": [1, 2]})
app = web.Application()
app.router.add_post("/function/{name}", answer)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
"""


@pytest.fixture
def endpoint():
    servers = []

    def start(sleep_s: float) -> str:
        port = free_port()
        servers.append(subprocess.Popen([sys.executable, "-c", ENDPOINT, str(port), str(sleep_s)]))
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return f"http://127.0.0.1:{port}"
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("the endpoint did not start")
    yield start
    for s in servers:
        s.terminate()
        s.wait()


def test_the_client_keeps_its_schedule_open_loop(endpoint):
    url = endpoint(0.3)  # every answer takes 0.3 s: a closed loop would fall behind
    times = arr.poisson_arrivals(100.0, 2.0, seed=1)
    requests = [Request(i, float(t), "m", {}, 5, 0) for i, t in enumerate(times)]
    records, started = run(url, requests, progress=False)
    assert abs(started - time.time()) < 60
    assert [r.index for r in records] == list(range(len(requests)))
    assert all(r.ok for r in records) and all(r.latency_s >= 0.29 for r in records)
    errors = np.array([r.schedule_error_s for r in records])
    assert (errors >= 0).all() and np.median(errors) < 0.05
    assert records[0].stages == [{"stage": 0, "queue_ms": 1.0, "service_ms": 2.0}] and records[0].output_tokens == 2


def test_ctrl_c_stops_sending_and_keeps_what_was_measured(endpoint):
    url = endpoint(5.0)
    requests = [Request(i, i * 0.1, "m", {}, 0, 0) for i in range(40)]
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    records, _ = run(url, requests, progress=False, grace_s=0.5)
    sent = [r for r in records if r.sent >= 0]
    assert 3 <= len(sent) < 40 and len(records) == 40
    assert all(r.status == 0 and r.error == "stopped before an answer came" for r in sent)
    assert all(r.sent == -1 for r in records[len(sent):])


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


def test_compare_runs_every_policy_and_writes_one_report(tmp_path, home_settings):
    out = tmp_path / "report"
    proc = subprocess.run(
        [sys.executable, "-m", "loadgen", "compare", "--stack-file", "stack-emulated.yml", "--model", "llama-7b",
         "--policies", "quart,static", "--rate", "6", "--cv", "2", "--duration", "5", "--tail", "2",
         "--out", str(out), "--no-progress", "--home", str(tmp_path / "home"),
         "--models", str(home_settings.models_dir)],
        cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert list(results["runs"]) == ["quart", "static"]
    for policy, run_ in results["runs"].items():
        s = run_["summary"]
        assert s["sent"] == s["ok"] > 0 and s["replica_seconds"] > 0
        assert len(run_["timeline"]["cv"]) == 8 and len(run_["timeline"]["replicas"]) == 8
        assert len((out / f"records-{policy}.jsonl").read_text().splitlines()) == s["sent"]
    report = (out / "report.md").read_text()
    assert "| quart |" in report and "| static |" in report
    for png in ("latency_cdf.png", "slo_attainment.png", "timelines.png", "stages.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
