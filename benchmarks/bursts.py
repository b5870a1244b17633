"""Bursts served within their objectives: an open-loop trace of ShareGPT chat prompts (16 new
tokens each, end of text ignored, Gamma arrivals) at 1, 2 and 4 requests/s, CV 1 and 4, replayed
against

- `pipeline`: SmolLM2 in 4 stages on the embedded runtime, one replica each, no autoscaler, no
  objectives (a generation is admitted while it can finish within the request timeout);
- `pipeline + objectives`: the same with a TTFT objective of 2 s and a TPOT objective of 0.2 s
  (QUART_TTFT_OBJECTIVE_S, QUART_TPOT_OBJECTIVE_S: 16 tokens are due in 2 + 15 × 0.2 = 5 s), so
  the entry bounds what runs by the TPOT it measures, queues the rest earliest deadline first
  and refuses what it predicts would miss its deadline;
- `generate FIFO`: the unsplit model's `generate` (served dtype, every core) answering one
  request at a time in arrival order. Its latencies come from the trace and each prompt's
  service time measured here back to back (a FIFO single server's waits follow from those
  exactly), not from a live server: it is the baseline at its best, without HTTP;
- `vllm-cpu`: vLLM's CPU build serving the same checkpoint in the served dtype through its
  OpenAI server (`benchmarks/vllm_cpu.py`: its own virtual environment, its own core binding),
  the same traces replayed against its completions with the same greedy 16 tokens; `--no-vllm`
  leaves it out, and it is left out with the reason printed where it cannot be installed.

Goodput: requests answered within a 5 s end-to-end objective, per second of the trace. Refusals
(429) and the time generations waited at the entry are reported apart, and of the requests the
pipeline with objectives refused, those that the run without objectives answered within 5 s
(the same trace with nothing refused, so more in flight: such a refusal was most likely wrong,
and one that the other run did not answer in time may still have been right or wrong).

    python -m benchmarks bursts
    python -m benchmarks bursts --seconds 30 --rates 2 --cvs 4
"""
from __future__ import annotations

import argparse
import asyncio
import math
import os
from pathlib import Path

import numpy as np
import torch

from benchmarks import vllm_cpu
from benchmarks.generation import Unsplit, running
from benchmarks.report import RESULTS, SERVING, conditions, table, write
from contracts.config import load_settings
from loadgen.arrivals import gamma_arrivals
from loadgen.client import OPENAI_PATH, Record, replay
from loadgen.requests import Request, as_openai
from loadgen.sharegpt import first_prompts
from models.manifest import Manifest
from models.precision import serving_dtype

MEASURES = SERVING + ("loadgen", "benchmarks/vllm_cpu.py")  # the code measured (benchmarks/freshness.py)

MODEL, NEW, OBJECTIVE_S = "smollm2", 16, 5.0
TTFT_OBJECTIVE_S, TPOT_OBJECTIVE_S = 2.0, 0.2
PROMPTS = 40
PIPELINES = {"pipeline": {}, "pipeline + objectives": {"ttft_objective_s": TTFT_OBJECTIVE_S,
                                                       "tpot_objective_s": TPOT_OBJECTIVE_S}}
PLAIN, GUARDED = PIPELINES
FIFO = "generate FIFO"
VLLM = vllm_cpu.PACKAGE


def trace(rate: float, cv: float, seconds: float, prompts: list[str], seed: int) -> list[Request]:
    times = gamma_arrivals(rate, cv, seconds, seed)
    return [Request(i, float(t), MODEL, {"prompt": prompts[i % len(prompts)], "max_new_tokens": NEW,
                                         "ignore_eos": True}, 0, NEW) for i, t in enumerate(times)]


def fifo_latencies(arrivals: list[float], service_s: list[float]) -> list[float]:
    """A single server answering in arrival order: each starts when it arrives or when the one
    before ends, whichever is later."""
    free, out = 0.0, []
    for at, service in zip(arrivals, service_s):
        free = max(free, at) + service
        out.append(free - at)
    return out


def point(records: list[Record], seconds: float) -> dict:
    sent = [r for r in records if r.sent >= 0]
    ok = [r for r in sent if r.ok]
    return summary(len(sent), [r.latency_s for r in ok], [r.queued_s for r in ok if r.queued_s >= 0],
                   sum(r.status == 429 for r in sent), sum(not r.ok and r.status != 429 for r in sent), seconds)


def refused_yet_met(guarded: list[Record], plain: list[Record]) -> int:
    """Requests that `guarded` refused (429) and `plain`, the same trace, answered within the
    objective (records in the trace's order)."""
    return sum(g.status == 429 and p.ok and p.latency_s <= OBJECTIVE_S for g, p in zip(guarded, plain, strict=True))


def summary(sent: int, latencies: list[float], queued: list[float], refused: int, failed: int,
            seconds: float) -> dict:
    return {"sent": sent, "answered": len(latencies), "refused": refused, "failed": failed,
            "goodput_per_s": sum(lat <= OBJECTIVE_S for lat in latencies) / seconds,
            "mean_s": float(np.mean(latencies)) if latencies else math.nan,
            "p99_s": float(np.percentile(latencies, 99)) if latencies else math.nan,
            "queued_mean_s": float(np.mean(queued)) if queued else math.nan}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--rates", type=lambda v: [float(x) for x in v.split(",")], default=[1.0, 2.0, 4.0])
    parser.add_argument("--cvs", type=lambda v: [float(x) for x in v.split(",")], default=[1.0, 4.0])
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--no-vllm", action="store_true", help="without the vLLM-CPU baseline")
    args = parser.parse_args(argv)
    prompts = first_prompts(PROMPTS, seed=args.seed, max_chars=400)
    points = [(rate, cv) for rate in args.rates for cv in args.cvs]
    traces = {(rate, cv): trace(rate, cv, args.seconds, prompts, args.seed) for rate, cv in points}
    results: dict[tuple[str, float, float], dict] = {}
    replayed: dict[tuple[str, float, float], list[Record]] = {}
    service: list[float] = []
    for name, changes in PIPELINES.items():
        with running(MODEL, NEW, **changes) as settings:
            if not service:
                service, served, checkpoint = _fifo_service(settings, prompts)
            for rate, cv in points:
                print(f"  {name}: {rate:g} requests/s, CV {cv:g}, {args.seconds:g} s", flush=True)
                records = asyncio.run(replay(settings.gateway.url, traces[(rate, cv)], timeout_s=600, progress=False))
                results[(name, rate, cv)] = point(records, args.seconds)
                replayed[(name, rate, cv)] = records
    for rate, cv in points:
        results[(GUARDED, rate, cv)]["refused_yet_met"] = refused_yet_met(replayed[(GUARDED, rate, cv)],
                                                                          replayed[(PLAIN, rate, cv)])
    for (rate, cv), requests in traces.items():
        services = [service[r.index % len(prompts)] for r in requests]
        latencies = fifo_latencies([r.at for r in requests], services)
        results[(FIFO, rate, cv)] = summary(len(requests), latencies, [x - s for x, s in zip(latencies, services)],
                                            0, 0, args.seconds)
    vllm = None if args.no_vllm else _vllm_points(checkpoint, served, traces, args.seconds, results)
    return _report(results, points, args, served, vllm)


def _fifo_service(settings, prompts: list[str]) -> tuple[list[float], torch.dtype, tuple[Path, Path, str]]:
    """Each prompt's service time under `generate` alone, back to back (the pipeline idle); the
    served dtype; the checkpoint's folder, tokenizer and architecture (for vLLM-CPU)."""
    from transformers import AutoTokenizer
    served = serving_dtype(settings.compute.dtype, Manifest.load(settings.model_dir(MODEL)).dtype,
                           settings.compute.device)
    unsplit = Unsplit(settings, MODEL, served)
    tokenizer = AutoTokenizer.from_pretrained(unsplit.source.tokenizer_dir)
    cores = len(os.sched_getaffinity(0))
    out = []
    for i, text in enumerate(prompts):
        print(f"  {FIFO}: service time of prompt {i + 1}/{len(prompts)}", flush=True)
        ttft_ms, tpot_ms, _ = unsplit.one(tokenizer(text)["input_ids"], NEW, served, cores)
        out.append((ttft_ms + tpot_ms * (NEW - 1)) / 1000.0)
    files = unsplit.files
    del unsplit
    return out, served, files


def _vllm_points(checkpoint: tuple[Path, Path, str], served: torch.dtype, traces: dict, seconds: float,
                 results: dict) -> dict | None:
    """vLLM-CPU answering each trace (after the pipelines' runtimes have stopped, so neither takes
    the other's cores), into `results`; its conditions. None, with the reason printed, where it
    cannot run."""
    try:
        with vllm_cpu.started(Path(load_settings().home), checkpoint, MODEL, str(served).removeprefix("torch.")) \
                as (url, ran_as):
            for (rate, cv), requests in traces.items():
                print(f"  {VLLM}: {rate:g} requests/s, CV {cv:g}, {seconds:g} s", flush=True)
                records = asyncio.run(replay(url, [as_openai(r) for r in requests], timeout_s=600, progress=False,
                                             path=OPENAI_PATH))
                results[(VLLM, rate, cv)] = point(records, seconds)
    except (vllm_cpu.Unavailable, OSError) as exc:
        print(f"vLLM-CPU is not a baseline in this run: {exc}", flush=True)
        return None
    return ran_as


def _report(results: dict, points: list, args, served: torch.dtype, vllm: dict | None) -> dict:
    systems = [*PIPELINES, FIFO, *([VLLM] if vllm else [])]
    rows, figures = [], []
    for rate, cv in points:
        for system in systems:
            p = results[(system, rate, cv)]
            rows.append([f"{rate:g}/s CV {cv:g}", system, p["sent"], p["answered"], p["refused"], p["failed"],
                         p["goodput_per_s"], p["mean_s"], p["p99_s"], p["queued_mean_s"]])
            for key, unit in (("goodput_per_s", "requests/s within 5 s"), ("refused", "requests"),
                              ("failed", "requests"), ("mean_s", "s"), ("p99_s", "s"), ("queued_mean_s", "s"),
                              ("sent", "requests"), ("answered", "requests")):
                figures.append({"name": f"{system}, {rate:g} requests/s, CV {cv:g}: {key}",
                                "value": round(p[key], 4) if isinstance(p[key], float) else p[key], "unit": unit})
        figures.append({"name": f"{GUARDED}, {rate:g} requests/s, CV {cv:g}: refused, yet answered within "
                                f"{OBJECTIVE_S:g} s by {PLAIN}", "value": results[(GUARDED, rate, cv)]["refused_yet_met"],
                        "unit": "requests", "target": "0"})
        best = max(results[(s, rate, cv)]["goodput_per_s"] for s in PIPELINES)
        for baseline in systems[len(PIPELINES):]:
            theirs = results[(baseline, rate, cv)]["goodput_per_s"]
            figures.append({"name": f"best pipeline goodput over {baseline}'s, {rate:g} requests/s, CV {cv:g}",
                            "value": round(best / theirs, 3) if theirs else None, "unit": "ratio", "target": ">= 1"})
    print(table(f"Bursts: SmolLM2, {NEW} new tokens, {args.seconds:g} s per point, goodput within {OBJECTIVE_S:g} s "
                f"({served})", ["trace", "system", "sent", "answered", "refused", "failed", "goodput/s", "mean s",
                               "p99 s", "queued s"], rows))
    print(f"refused by {GUARDED}, yet answered within {OBJECTIVE_S:g} s by {PLAIN}: " + ", ".join(
        f"{rate:g}/s CV {cv:g}: {results[(GUARDED, rate, cv)]['refused_yet_met']}" for rate, cv in points))
    _plot(results, points, systems)
    write("bursts", figures, conditions(model=MODEL, new_tokens=NEW, seconds=args.seconds, seed=args.seed,
                                        prompts=PROMPTS, objective_s=OBJECTIVE_S, ttft_objective_s=TTFT_OBJECTIVE_S,
                                        tpot_objective_s=TPOT_OBJECTIVE_S, dtype=str(served), policy="none",
                                        plot="bursts.png",
                                        vllm_cpu=vllm or "absent (the run's output says why)"))
    return {"figures": figures}


def _plot(results: dict, points: list, systems: list[str]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cvs = sorted({cv for _, cv in points})
    fig, axes = plt.subplots(1, len(cvs), figsize=(5 * len(cvs), 3.6), squeeze=False)
    for ax, cv in zip(axes[0], cvs):
        rates = [rate for rate, c in points if c == cv]
        for system in systems:
            ax.plot(rates, [results[(system, rate, cv)]["goodput_per_s"] for rate in rates], marker="o", label=system)
        ax.plot(rates, rates, color="grey", lw=0.8, ls="--", label="offered")
        ax.set(xlabel="requests/s offered", ylabel=f"answered within {OBJECTIVE_S:g} s per s", title=f"CV {cv:g}")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "bursts.png", dpi=110)
