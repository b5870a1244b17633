"""The overload curve: offered rate against answered rate and latency, with and without the
entry's admission control, on the embedded runtime (emulated 8-stage WideResNet, one replica per
stage, static policy, Poisson arrivals).

    python -m benchmarks overload [--seconds 20]

The sustainable rate is measured first (a closed loop of 8 clients); then, for each multiple of
it, an open-loop replay with QUART_ADMIT_WAIT_S at its default and at 0 (no admission control).
Per run: requests answered 200 per second, refused (429), timed out or failed, and the p50/p99
latency of the ones answered 200."""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from benchmarks.report import RESULTS, SERVING, conditions, scratch, table, write
from contracts.config import Settings, load_settings
from loadgen.arrivals import poisson_arrivals
from loadgen.client import replay
from loadgen.closed_loop import ClosedLoop
from loadgen.requests import Request
from models.profiles import write_stack
from runtime import __main__ as control
from runtime.ports import free_port

MEASURES = SERVING + ("loadgen",)  # the code measured (benchmarks/freshness.py)

MODEL, MULTIPLES, TIMEOUT_S = "wideresnet", (0.5, 1.0, 2.0, 4.0), 30.0
BODY = {"tokens": 16}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each open-loop run")
    args = parser.parse_args(argv or [])
    base = load_settings()
    runs, sustainable = [], 0.0
    for admit_wait_s in (base.data.admit_wait_s, 0.0):
        with _runtime(base, admit_wait_s) as settings:
            if not sustainable:
                sustainable = _sustainable_rate(settings)
                print(f"  sustainable: {sustainable:.2f} requests/s", flush=True)
            for multiple in MULTIPLES:
                print(f"  admission {'on' if admit_wait_s else 'off'}, {multiple:g}x", flush=True)
                runs.append(_run(settings, admit_wait_s, multiple, sustainable * multiple, args.seconds))
                time.sleep(TIMEOUT_S / 3)  # what is left of this run's queues drains before the next
    return _report(runs, sustainable, base.data.admit_wait_s, args.seconds)


@contextmanager
def _runtime(base: Settings, admit_wait_s: float) -> Iterator[Settings]:
    """A runtime of its own for one admission setting, removed afterwards."""
    with scratch("quart-overload-") as home:
        settings = base.replace(
            home=str(home), models=str(base.models_dir), stack_file=str(write_stack(MODEL, home / "stack.yml")),
            gateway_port=free_port(), redis_port=free_port(), keysmanager_port=free_port(), policy="static",
            cache_stages="none", request_timeout_s=TIMEOUT_S, admit_wait_s=admit_wait_s)
        try:
            if control.up(settings, timeout=900) != 0:
                raise SystemExit(f"the runtime did not come up; see {home}/logs")
            yield settings
        finally:
            control.down(settings)


def _sustainable_rate(settings: Settings, seconds: float = 20.0) -> float:
    with ClosedLoop(settings.gateway.url, MODEL, BODY, clients=8, timeout_s=TIMEOUT_S) as load:
        time.sleep(5.0)
        start = time.monotonic()
        time.sleep(seconds)
        end = time.monotonic()
    return sum(o.status == 200 and start <= o.answered <= end for o in load.outcomes) / (end - start)


def _run(settings: Settings, admit_wait_s: float, multiple: float, rate: float, seconds: float) -> dict:
    at = poisson_arrivals(rate, seconds, seed=int(multiple * 100))
    requests = [Request(i, float(t), MODEL, BODY, 16, 0) for i, t in enumerate(at)]
    records = asyncio.run(replay(settings.gateway.url, requests, timeout_s=TIMEOUT_S + 30, progress=False))
    ok = [r.latency_s * 1000 for r in records if r.status == 200]
    refused = [r.latency_s * 1000 for r in records if r.status == 429]
    return {"admission": admit_wait_s > 0, "multiple": multiple, "offered_per_s": len(requests) / seconds,
            "answered_per_s": len(ok) / seconds, "refused": len(refused), "sent": len(requests),
            "timed_out": sum(r.status == 504 for r in records),
            "failed": sum(r.status not in (200, 429, 504) for r in records),
            "p50_ms": float(np.percentile(ok, 50)) if ok else float("nan"),
            "p99_ms": float(np.percentile(ok, 99)) if ok else float("nan"),
            "refusal_p50_ms": float(np.percentile(refused, 50)) if refused else float("nan")}


def _report(runs: list[dict], sustainable: float, admit_wait_s: float, seconds: float) -> dict:
    rows, figures = [], [{"name": "sustainable rate (closed loop, 8 clients)", "value": round(sustainable, 3),
                          "unit": "requests/s"}]
    for r in runs:
        label = f"admission {'on' if r['admission'] else 'off'}, {r['multiple']:g}x"
        rows.append([label, r["offered_per_s"], r["answered_per_s"], r["refused"], r["timed_out"], r["failed"],
                     r["p50_ms"], r["p99_ms"], r["refusal_p50_ms"]])
        figures += [{"name": f"{label}: {k}", "value": round(v, 3) if isinstance(v, float) else v,
                     "unit": unit} for k, v, unit in (
            ("offered", r["offered_per_s"], "requests/s"), ("answered 200", r["answered_per_s"], "requests/s"),
            ("refused 429", r["refused"], "requests"), ("timed out 504", r["timed_out"], "requests"),
            ("failed otherwise", r["failed"], "requests"), ("p50 latency of 200s", r["p50_ms"], "ms"),
            ("p99 latency of 200s", r["p99_ms"], "ms"), ("p50 latency of 429s", r["refusal_p50_ms"], "ms"))]
    print(table(f"Overload: emulated {MODEL}, 8 stages x 1 replica, Poisson, {seconds:g} s per run, "
                f"admission wait {admit_wait_s:g} s", ["run", "offered/s", "200/s", "429", "504", "other",
                                                         "p50 ms", "p99 ms", "429 p50 ms"], rows))
    write("overload", figures, conditions(model=MODEL, stages=8, emulated=True, replicas_per_stage=1,
                                          policy="static", arrivals="poisson", seconds_per_run=seconds,
                                          admit_wait_s=admit_wait_s, request_timeout_s=TIMEOUT_S))
    _plot(runs, sustainable)
    return {"figures": figures}


def _plot(runs: list[dict], sustainable: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (rate_ax, p99_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for admission, style in ((True, "o-"), (False, "s--")):
        mine = [r for r in runs if r["admission"] == admission]
        label = "admission control" if admission else "none"
        rate_ax.plot([r["offered_per_s"] for r in mine], [r["answered_per_s"] for r in mine], style, label=label)
        p99_ax.plot([r["offered_per_s"] for r in mine], [r["p99_ms"] / 1000 for r in mine], style, label=label)
    rate_ax.axvline(sustainable, color="grey", lw=0.8)
    rate_ax.set(xlabel="offered requests/s", ylabel="answered 200 per s", title="throughput")
    p99_ax.set(xlabel="offered requests/s", ylabel="p99 latency of 200s (s)", title="latency")
    p99_ax.axhline(TIMEOUT_S, color="grey", lw=0.8)
    for ax in (rate_ax, p99_ax):
        ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "overload.png", dpi=110)


if __name__ == "__main__":
    main(sys.argv[1:])
