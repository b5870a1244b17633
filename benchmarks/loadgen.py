"""The load generator itself, and the evaluation report it exists for.

1. Schedule error (actual send time - scheduled) at 200 and 1,000 requests per second, Poisson,
   against a trivial local endpoint in another process (target: p99 <= 5 ms at 200 rps).
2. EMULATED stages (QUART Table 1 LLaMA-7B, 8 stages): the same Gamma schedule at CV 1 and CV 4
   against QUART and every baseline, each on a fresh runtime, through `python -m loadgen compare`;
   the reports land in benchmarks/results/loadgen-cv1/ and loadgen-cv4/."""
from __future__ import annotations

import json
import subprocess
import sys
import time

from autoscaler.policy.controller import POLICIES
from benchmarks.report import RESULTS, SERVING, conditions, table, write
from contracts.paths import REPO_ROOT
from loadgen.arrivals import poisson_arrivals
from loadgen.client import run as replay
from loadgen.metrics import schedule_error
from loadgen.requests import Request
from runtime.ports import free_port

MEASURES = SERVING + ("loadgen",)  # the code measured (benchmarks/freshness.py)

ENDPOINT = """
import sys
from aiohttp import web

app = web.Application()
app.router.add_post("/function/{name}", lambda r: web.json_response({"ok": True}))
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
"""


def schedule_errors(rates: tuple[float, ...], seconds: float) -> list[dict]:
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", ENDPOINT, str(port)])
    try:
        time.sleep(1.5)
        out = []
        for rate in rates:
            times = poisson_arrivals(rate, seconds, seed=1)
            requests = [Request(i, float(t), "echo", {}, 0, 0) for i, t in enumerate(times)]
            records, _ = replay(f"http://127.0.0.1:{port}", requests, progress=False)
            err = schedule_error(records)
            out.append({"rate": rate, "requests": len(records), "ok": sum(r.ok for r in records), **err})
        return out
    finally:
        server.terminate()
        server.wait()


def report(cv: float, rate: float, seconds: float) -> dict:
    out = RESULTS / f"loadgen-cv{cv:g}"
    subprocess.run([sys.executable, "-m", "loadgen", "compare", "--stack-file", "stack-emulated.yml",
                    "--model", "llama-7b", "--policies", ",".join(POLICIES), "--arrivals", "gamma", "--rate", str(rate),
                    "--cv", str(cv), "--duration", str(seconds), "--seed", "4", "--tail", "15",
                    "--slo-s", "1.0", "--window-s", "5", "--out", str(out), "--no-progress"],
                   cwd=REPO_ROOT, check=True)
    return json.loads((out / "results.json").read_text())


def main(rate: float = 20.0, seconds: float = 30.0) -> dict:
    errors = schedule_errors((200.0, 1000.0), 10.0)
    print(table("Schedule error against a trivial local endpoint, Poisson, 10 s (ms)",
                ["rps", "requests", "ok", "p50 ms", "p99 ms", "max ms"],
                [[e["rate"], e["requests"], e["ok"], round(e["p50_ms"], 3), round(e["p99_ms"], 3),
                  round(e["max_ms"], 3)] for e in errors]))
    figures = []
    for e in errors:
        figures += [{"name": f"schedule error p50 at {e['rate']:g} rps", "value": round(e["p50_ms"], 3), "unit": "ms"},
                    {"name": f"schedule error p99 at {e['rate']:g} rps", "value": round(e["p99_ms"], 3), "unit": "ms"}]
    reports = {}
    for cv in (1.0, 4.0):
        reports[cv] = report(cv, rate, seconds)
        rows = []
        for policy, run in reports[cv]["runs"].items():
            s = run["summary"]
            rows.append([policy, f"{s['ok']}/{s['sent']}", round(s["latency_s"]["mean"] * 1000, 1),
                         round(s["latency_s"]["p99"] * 1000, 1), round(100 * s["slo_attainment"]["2"], 1),
                         round(s["goodput"]["requests_per_s"], 2), round(s["replica_seconds"], 0)])
            figures += [{"name": f"cv{cv:g} {policy} mean latency", "value": round(s["latency_s"]["mean"] * 1000, 2), "unit": "ms"},
                        {"name": f"cv{cv:g} {policy} p99 latency", "value": round(s["latency_s"]["p99"] * 1000, 2), "unit": "ms"},
                        {"name": f"cv{cv:g} {policy} SLO attainment at 2x", "value": round(s["slo_attainment"]["2"], 4), "unit": "fraction"},
                        {"name": f"cv{cv:g} {policy} goodput", "value": round(s["goodput"]["requests_per_s"], 3), "unit": "req/s"},
                        {"name": f"cv{cv:g} {policy} replica-seconds", "value": round(s["replica_seconds"], 1), "unit": "replica-s"}]
        print(table(f"EMULATED LLaMA-7B, Gamma {rate:g} rps CV {cv:g}, {seconds:g} s (report: "
                    f"benchmarks/results/loadgen-cv{cv:g}/report.md)",
                    ["policy", "ok", "mean ms", "p99 ms", "SLO 2x %", "goodput req/s", "replica-s"], rows))
    write("loadgen", figures, conditions(endpoint="aiohttp, another process, loopback", schedule_seconds=10,
                                         emulated_profile="QUART Table 1 LLaMA-7B over 8 stages", rate_rps=rate,
                                         seconds=seconds, seed=4, slo_s=1.0, window_s=5))
    return {"errors": errors, "reports": reports}


if __name__ == "__main__":
    main()
