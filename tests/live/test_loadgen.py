"""The load generator: trace readers on small files written here, the Gamma generator's rate and
CV, the open-loop client against a real local HTTP server (its schedule, Ctrl-C), the metrics on
hand-computed cases, and the comparison command end to end on emulated stages."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from contracts.paths import REPO_ROOT as REPO
from loadgen import arrivals as arr
from loadgen.client import OPENAI_PATH, run
from loadgen.report import records_dir
from loadgen.requests import Request, as_openai
from runtime.ports import free_port

ENDPOINT = """
import asyncio, json, sys
from aiohttp import web
async def answer(request):
    await asyncio.sleep(float(sys.argv[2]))
    return web.json_response({"stages": [{"stage": 0, "queue_ms": 1.0, "service_ms": 2.0}], "token_ids": [1, 2]})
async def completions(request):  # an OpenAI-compatible server's answer: tokens counted in its usage
    body = await request.json()
    usage = {"prompt_tokens": 3, "completion_tokens": body["max_tokens"]}
    if not body.get("stream"):
        return web.json_response({"model": body["model"], "choices": [{"text": "x" * body["max_tokens"]}],
                                  "usage": usage})
    reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await reply.prepare(request)
    send = lambda event: reply.write(("data: " + json.dumps(event) + "\\n\\n").encode())
    await asyncio.sleep(0.3)  # the prefill
    for k in range(body["max_tokens"]):
        if body["prompt"] == "fail" and k == 1:
            await send({"error": {"message": "the engine died", "code": 500}})
            return reply
        await send({"choices": [{"index": 0, "text": "x"}]})
        await asyncio.sleep(0.05)
    await send({"choices": [], "usage": usage})
    await reply.write(b"data: [DONE]\\n\\n")
    return reply
app = web.Application()
app.router.add_post("/function/{name}", answer)
app.router.add_post("/v1/completions", completions)
app.router.add_get("/v1/models", lambda request: web.json_response({"object": "list", "data": []}))
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


def test_the_client_replays_against_an_openai_compatible_server(endpoint):
    url = endpoint(0.0)
    requests = [Request(i, 0.05 * i, "m", {"model": "m", "prompt": "hi", "max_tokens": 3 + i}, 1, 3 + i)
                for i in range(4)]
    records, _ = run(url, requests, progress=False, path=OPENAI_PATH)
    assert all(r.ok for r in records), [r.error for r in records]
    assert [r.output_tokens for r in records] == [3, 4, 5, 6]
    # Without a path: the gateway's function route, as before.
    assert run(url, requests[:1], progress=False)[0][0].output_tokens == 2


def test_the_client_times_a_streamed_completion_and_fails_on_an_error_in_the_stream(endpoint):
    url = endpoint(0.0)
    requests = [as_openai(Request(i, 0.0, "m", {"prompt": prompt, "max_new_tokens": 5}, 1, 5))
                for i, prompt in enumerate(["hi", "fail"])]
    good, bad = run(url, requests, progress=False, path=OPENAI_PATH)[0]
    assert good.ok and good.output_tokens == 5, good.error
    assert 0.3 <= good.ttft_s < good.latency_s and 0.04 <= good.tpot_s < 0.3   # 0.3 s prefill, 50 ms a token
    assert bad.status == 0 and bad.error == "the engine died" and not bad.ok
    with pytest.raises(ValueError, match="only generative"):
        as_openai(Request(0, 0.0, "llama-7b", {"tokens": 16}, 16, 0))


def test_replay_against_an_openai_compatible_server_from_the_command_line(endpoint, tmp_path):
    url, out = endpoint(0.0), tmp_path / "report"
    command = [sys.executable, "-m", "loadgen", "replay", "--openai", url, "--model", "m", "--arrivals", "poisson",
               "--rate", "4", "--duration", "2", "--max-new-tokens", "4", "--tail", "0", "--out", str(out),
               "--no-progress", "--home", str(tmp_path / "home")]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads((out / "results.json").read_text())["runs"]["openai"]["summary"]
    assert summary["sent"] == summary["ok"] > 0 and 0.45 < summary["profiled_s"] < 2.0
    tokens = summary["tokens"]   # 0.3 s to the first token, 50 ms a token after it, as the client saw them
    assert 0.3 <= tokens["ttft_s"]["p50"] < 1.0 and 0.04 <= tokens["tpot_s"]["p50"] < 0.3
    assert (out / "latency_cdf.png").exists() and not (out / "timelines.png").exists()
    for wrong, says in ((["--model", "llama-7b"], "only generative"), (["--openai", url + "/nothing"], "/v1/models")):
        refused = subprocess.run([*command, *wrong], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert refused.returncode != 0 and says in refused.stderr, refused.stderr[-2000:]


def test_ctrl_c_stops_sending_and_keeps_what_was_measured(endpoint):
    url = endpoint(5.0)
    requests = [Request(i, i * 0.1, "m", {}, 0, 0) for i in range(40)]
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    records, _ = run(url, requests, progress=False, grace_s=0.5)
    sent = [r for r in records if r.sent >= 0]
    assert 3 <= len(sent) < 40 and len(records) == 40
    assert all(r.status == 0 and r.error == "stopped before an answer came" for r in sent)
    assert all(r.sent == -1 for r in records[len(sent):])


def test_compare_runs_every_policy_and_writes_one_report(tmp_path, home_settings):
    out = tmp_path / "report"
    proc = subprocess.run(
        [sys.executable, "-m", "loadgen", "compare", "--stack-file", "stack-emulated.yml", "--model", "llama-7b",
         "--policies", "quart,static", "--rate", "6", "--cv", "2", "--duration", "5", "--tail", "2",
         "--out", str(out), "--no-progress", "--home", str(tmp_path / "home"),
         "--models", str(home_settings.models_dir)],
        # Admission off, as in the runtime fixture: this test asserts every request is answered, and
        # a loaded CI host refused the last of a burst (429, a queue predicted over 2 s).
        # tests/live/test_overload.py covers admission.
        cwd=REPO, capture_output=True, text=True, timeout=900, env={**os.environ, "QUART_ADMIT_WAIT_S": "0"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert list(results["runs"]) == ["quart", "static"]
    for policy, run_ in results["runs"].items():
        s = run_["summary"]
        assert s["sent"] == s["ok"] > 0 and s["replica_seconds"] > 0
        assert len(run_["timeline"]["cv"]) == 8 and len(run_["timeline"]["replicas"]) == 8
        # The per-request records are kept in QUART_HOME, not in the report's folder.
        kept = records_dir(tmp_path / "home", out) / f"records-{policy}.jsonl"
        assert len(kept.read_text().splitlines()) == s["sent"] and not (out / f"records-{policy}.jsonl").exists()
    report = (out / "report.md").read_text()
    assert "| quart |" in report and "| static |" in report
    for png in ("latency_cdf.png", "slo_attainment.png", "timelines.png", "stages.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    # Drawn again from results.json and the kept records, as it was.
    (out / "report.md").unlink()
    (out / "latency_cdf.png").unlink()
    again = subprocess.run([sys.executable, "-m", "loadgen.report", str(out), "--home", str(tmp_path / "home")],
                           cwd=REPO, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-2000:]
    assert (out / "report.md").read_text() == report and (out / "latency_cdf.png").read_bytes()[:4] == b"\x89PNG"
