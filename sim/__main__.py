"""Cluster simulator: the live policies, scheduler and KeysManager rule on a simulated cluster.

    python -m sim --model llama-7b,bert-21b --policies quart,static --arrivals gamma --rate 20 \\
        --cv 4 --duration 600 --out reports/sim-cv4
        QUART's testbed (12 servers x 4 GPUs, 1 TB each), one run per policy, one report
    python -m sim --preset embedded --model llama-7b ...
        this repository's embedded runtime on a 2-core host (for calibration)
    python -m sim --preset embedded --model smollm2 --new-tokens 64 --arrivals poisson --rate 1 ...
        a generative model whose stages' batched steps were measured (sim/calibration/; made
        by `python -m sim.calibrate`): prefill, then decode steps batched on the replicas holding
        each request's KV cache, with TTFT, TPOT and token goodput in the report

Arrivals take the load generator's options (gamma, poisson, azure, burstgpt). The report is the
load generator's: tables, latency CDF, SLO attainment, timelines and per-stage CV and queue."""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from autoscaler.policy.controller import POLICIES
from contracts.config import load_settings
from loadgen.__main__ import add_arrival_arguments, arrival_times
from loadgen.report import write
from sim.config import SimConfig, embedded_runtime, quart_testbed
from sim.models import resolve
from sim.run import report_run, simulate

PRESETS = {"testbed": quart_testbed, "embedded": embedded_runtime}


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-7b",
                   help="QUART Table 1 model(s) or calibrated generative ones, comma-separated, or 'all' (Table 1)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens each request of a generative model makes")
    add_arrival_arguments(p)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--preset", choices=sorted(PRESETS), default="testbed")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="override a SimConfig field, e.g. --set servers=24 --set init_s=10")
    p.add_argument("--home", default=None, help="where a trained CV model and CPU fits are read (QUART_HOME)")
    p.add_argument("--out", default=None, help="report folder (default: no report, summary only)")
    return p.parse_args(argv)


def config(a: argparse.Namespace) -> SimConfig:
    cfg = PRESETS[a.preset](seed=a.seed)
    kinds = {f.name: f.type for f in dataclasses.fields(SimConfig)}
    changes = {}
    for item in a.set:
        name, _, raw = item.partition("=")
        if name not in kinds:
            raise SystemExit(f"--set {item}: no such field; known: {sorted(kinds)}")
        current = getattr(cfg, name)
        try:
            if isinstance(current, bool):
                if raw.lower() not in ("true", "false"):
                    raise ValueError(raw)
                changes[name] = raw.lower() == "true"
            else:
                changes[name] = raw if isinstance(current, str) else type(current)(raw)
        except ValueError:
            raise SystemExit(f"--set {item}: {name} takes a {type(current).__name__}") from None
    return cfg.replace(**changes)


def main(argv: list[str] | None = None) -> int:
    a = parse(sys.argv[1:] if argv is None else argv)
    names = None if a.model == "all" else [m.strip() for m in a.model.split(",") if m.strip()]
    try:
        models = resolve(names, a.new_tokens)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    cfg = config(a)
    times, _, _ = arrival_times(a, [m.name for m in models])
    settings = load_settings(home=a.home)
    runs = {}
    for policy in [p.strip() for p in a.policies.split(",") if p.strip()]:
        started = time.perf_counter()
        try:
            trace = simulate(cfg, models, times, policy, settings)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
        runs[policy] = report_run(trace, cfg, models, detail=a.out is not None)
        s = runs[policy]["summary"]
        print(f"{policy}: {s['ok']}/{s['sent']} answered, mean {s['latency_s']['mean'] * 1000:.0f} ms, "
              f"p99 {s['latency_s']['p99'] * 1000:.0f} ms, goodput {s['goodput']['requests_per_s']:.2f} req/s, "
              f"{trace.starts['fork']} forks, {trace.starts['cold']} cold starts, {trace.starts['peer']} peer starts "
              f"({trace.end:.0f} s simulated in {time.perf_counter() - started:.1f} s)", flush=True)
        if "tokens" in s:
            t = s["tokens"]
            print(f"  TTFT p50 {t['ttft_s']['p50'] * 1000:.0f} ms, TPOT p50 {t['tpot_s']['p50'] * 1000:.0f} ms, "
                  f"SLO attainment TTFT {t['ttft_attainment']:.1%} / TPOT {t['tpot_attainment']:.1%}, "
                  f"token goodput {t['token_goodput_per_s']:.1f}/s", flush=True)
    if a.out:
        conditions = {"simulated": True, "preset": a.preset, "models": ",".join(m.name for m in models),
                      "arrivals": a.arrivals, "rate_rps": a.rate, "cv": a.cv, "duration_s": a.duration,
                      "seed": a.seed, **{k: v for k, v in dataclasses.asdict(cfg).items() if k != "seed"}}
        path = write(Path(a.out), "Simulated replay", conditions, runs, Path(settings.home))
        print(f"report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
