"""What one request costs the host's cores on the embedded runtime, by process kind: the data
plane's CPU per request (which bounds the requests per second the cores can carry through the
pipeline, however many replicas there are), from the processes' own CPU counters.

EMULATED LLaMA-7B over 8 stages (its compute is a sleep, so what is counted is the data plane:
pack and unpack, Redis, HTTP), static policy, nothing being cached. The runtime's processes are
counted idle for 10 s, then under Poisson arrivals at each rate; per request: the loaded CPU
seconds less the idle rate over the same time, over the requests sent. The load generator runs in
this process and is counted too (it shares the cores in every live benchmark).

    python -m benchmarks data_plane_cpu
    python -m benchmarks.data_plane_cpu [--rates 10,20] [--seconds 15]"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections import defaultdict

from benchmarks.report import SERVING, conditions, scratch, table, write
from contracts.config import load_settings
from loadgen.arrivals import poisson_arrivals
from loadgen.client import replay
from loadgen.requests import Request
from models.profiles import write_stack
from runtime import __main__ as control
from runtime.ports import free_port

MEASURES = SERVING + ("loadgen",)  # the code measured (benchmarks/freshness.py)

MODEL = "llama-7b"
TICK = os.sysconf("SC_CLK_TCK")
# Process kind by what its command line runs, first match.
KINDS = (("redis-server", "redis"), ("functions/stage", "stages"), ("functions/entry", "entry"),
         ("keysmanager", "keysmanager"), ("autoscaler", "autoscaler"), ("runtime", "provider and gateway"))


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = defaultdict(list)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            children[int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])].append(int(pid))
        except OSError:
            continue
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def cpu_by_kind(root: int) -> dict[str, float]:
    """CPU seconds so far of the runtime's processes, by kind."""
    out: dict[str, float] = defaultdict(float)
    for pid in descendants(root):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        kind = next((k for pattern, k in KINDS if pattern in cmd), "other")
        out[kind] += (int(fields[11]) + int(fields[12])) / TICK
    return out


def own_cpu() -> float:
    t = os.times()
    return t.user + t.system


def measure(root: int, gateway: str, rate: float, seconds: float, idle: dict[str, float]) -> dict[str, float]:
    """CPU milliseconds per request by kind, the load generator's included."""
    at = poisson_arrivals(rate, seconds, seed=int(rate))
    requests = [Request(i, float(t), MODEL, {}, 16, 0) for i, t in enumerate(at)]
    before, mine, start = cpu_by_kind(root), own_cpu(), time.monotonic()
    records = asyncio.run(replay(gateway, requests, timeout_s=60, progress=False))
    elapsed, after = time.monotonic() - start, cpu_by_kind(root)
    if any(r.status != 200 for r in records):
        raise SystemExit(f"{sum(r.status != 200 for r in records)} of {len(records)} requests failed")
    per = {k: (after[k] - before.get(k, 0.0) - idle.get(k, 0.0) * elapsed) / len(requests) * 1000 for k in after}
    per["load generator"] = (own_cpu() - mine) / len(requests) * 1000
    return per


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="10,20")
    parser.add_argument("--seconds", type=float, default=15.0)
    a = parser.parse_args(argv or [])
    base = load_settings()
    with scratch("quart-plane-cpu-") as home:
        settings = base.replace(home=str(home), models=str(base.models_dir), stack_file=str(write_stack(MODEL, home / "stack.yml")),
                                gateway_port=free_port(), redis_port=free_port(), keysmanager_port=free_port(),
                                policy="static", cache_stages="none", admit_wait_s=0.0)
        try:
            if control.up(settings, timeout=600) != 0:
                raise SystemExit(f"the runtime did not come up; see {home}/logs")
            root = int((home / control.PID_FILE).read_text())
            first = cpu_by_kind(root)
            time.sleep(10.0)
            idle = {k: (v - first.get(k, 0.0)) / 10.0 for k, v in cpu_by_kind(root).items()}
            runs = {float(r): measure(root, settings.gateway.url, float(r), a.seconds, idle)
                    for r in a.rates.split(",")}
        finally:
            control.down(settings)
    kinds = sorted({k for per in runs.values() for k in per})
    rows = [[k] + [round(runs[r][k], 2) for r in runs] for k in kinds]
    rows.append(["total"] + [round(sum(per.values()), 2) for per in runs.values()])
    print(table(f"CPU ms per request, emulated {MODEL} (8 stages), static, by process kind",
                ["process"] + [f"{r:g} req/s" for r in runs], rows))
    totals = {r: sum(per.values()) for r, per in runs.items()}
    cores = len(os.sched_getaffinity(0))
    figures = [{"name": f"{k} CPU per request at {r:g} req/s", "value": round(per[k], 3), "unit": "ms"}
               for r, per in runs.items() for k in kinds]
    figures += [{"name": f"data plane CPU per request at {r:g} req/s", "value": round(t, 3), "unit": "ms",
                 "requests_per_s_the_cores_carry": round(cores * 1000 / t, 1)} for r, t in totals.items()]
    for r, t in totals.items():
        print(f"at {r:g} req/s: {t:.1f} ms of CPU a request: the {cores} cores carry at most {cores * 1000 / t:.0f} req/s")
    write("data_plane_cpu", figures, conditions(emulated=True, model=f"{MODEL} (8 stages)", policy="static",
                                                seconds=a.seconds, idle_s=10.0))
    return {"runs": runs, "totals": totals}


if __name__ == "__main__":
    main(sys.argv[1:])
