"""The simulator against the live pipeline, side by side in one run, for a generative model.

    python -m benchmarks simulator_generation

1. Calibration: each of SmolLM2's 4 stages alone, one thread, batched steps measured as a
   replica runs them (decode-only batches through the compiled step, the rest eager) and the
   cost model fitted (sim.calibrate; writes sim/calibration/smollm2.json, which the simulator ships).
2. Live: the embedded runtime, one replica per stage, no autoscaler, decode steps on each
   replica's own thread (QUART_IDLE_CORES=prefill); the generation benchmark's
   experiment: prompts one at a time, then 1, 4, 8 and 16 concurrent requests sent at once, 64
   new tokens each (end of text ignored); TTFT and TPOT as the answers report them, tokens/s
   over the wall time.
3. Fitted: two figures of the data plane besides the steps, each from one live figure: the
   hand-off latency from TPOT alone, and the CPU work per item outside the steps (packing,
   Redis, the entry), which takes its share of the 2 cores, from tokens/s at 16 at once. Both
   go into the calibration file.
4. Simulated: the same requests (their prompt lengths, all sent at once) on the simulator's
   embedded-runtime preset with that calibration, one replica per stage. Every other figure is
   out of sample.

Where the simulator differs, the ratio says by how much; docs/benchmarks.md says why."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np
import torch

from benchmarks.generation import pipeline_request, running
from benchmarks.report import RESULTS, SIMULATOR, conditions, table, write
from contracts.config import load_settings
from contracts.http_client import GatewayClient
from loadgen.sharegpt import first_prompts
from models.partition import ensure_partitioned
from sim.calibrate import calibrate
from sim.config import embedded_runtime
from sim.models import GenerativeModel
from sim.simulation import Simulation
from sim.step_cost import CALIBRATIONS, Calibration

# The code measured (benchmarks/freshness.py); not the calibration file, which this run writes.
MEASURES = SIMULATOR + ("autoscaler", "loadgen", "models", "contracts", ":(exclude)sim/calibration")

MODEL, STAGES, NEW = "smollm2", 4, 64
ALONE, LEVELS = 6, (1, 4, 8, 16)


def main() -> dict:
    torch.set_num_threads(1)
    manifest = ensure_partitioned(load_settings().models_dir, MODEL, STAGES)
    print("  calibrating", flush=True)
    cal = calibrate(manifest)
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(manifest.tokenizer_path())
    texts = first_prompts(ALONE + max(LEVELS), seed=21, max_chars=300)
    lengths = [len(tokenizer(t)["input_ids"]) for t in texts]
    # Decode steps on the replicas' own thread, as the calibration prices them: alone, a compiled
    # one would take the host's idle cores (QUART_IDLE_CORES=all), which the simulator does not model.
    with running(MODEL, NEW, idle_cores="prefill") as settings:
        client = GatewayClient(settings.gateway.url, timeout=900)
        live = [_live(client, texts[:ALONE], 1, "alone")] + \
               [_live(client, texts[ALONE:ALONE + c], c, f"{c} at once") for c in LEVELS]
    cal = _fit(cal, live, lengths)
    cal.save(CALIBRATIONS / f"{MODEL}.json")
    model = GenerativeModel(MODEL, cal, NEW)
    simulated = [_simulated(model, lengths[:ALONE], 1)] + [_simulated(model, lengths[ALONE:ALONE + c], c) for c in LEVELS]
    return _report(live, simulated, cal)


def _fit(cal: Calibration, live: list[dict], lengths: list[int]) -> Calibration:
    """The hand-off latency that makes TPOT alone what the live pipeline's was (TPOT is linear in
    it), then the CPU per item that makes tokens/s at 16 at once what it was (it falls as that
    grows: bisection)."""
    alone = lengths[:ALONE]
    tpot = [_simulated(GenerativeModel(MODEL, replace(cal, hop_s=h), NEW), alone, 1)["tpot"] for h in (0.0, 0.002)]
    hop = min(0.01, max(0.0, 0.002 * (live[0]["tpot"] - tpot[0]) / (tpot[1] - tpot[0])))
    cal = replace(cal, hop_s=round(hop, 6))
    busiest, low, high = lengths[ALONE:ALONE + LEVELS[-1]], 0.0, 0.01
    for _ in range(16):
        mid = (low + high) / 2
        tps = _simulated(GenerativeModel(MODEL, replace(cal, item_cpu_s=mid), NEW), busiest, LEVELS[-1])["tps"]
        low, high = (mid, high) if tps > live[-1]["tps"] else (low, mid)
    return replace(cal, item_cpu_s=round((low + high) / 2, 6))


def _live(client: GatewayClient, texts: list[str], concurrent: int, label: str) -> dict:
    print(f"  live: {label}", flush=True)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrent) as pool:
        answers = list(pool.map(lambda t: pipeline_request(client, MODEL, t, NEW), texts))
    wall = time.perf_counter() - t0
    return {"tps": sum(len(a["token_ids"]) for a in answers) / wall,
            "ttft": float(np.median([a["ttft_ms"] for a in answers])),
            "tpot": float(np.median([a["tpot_ms"] for a in answers]))}


def _simulated(model: GenerativeModel, lengths: list[int], concurrent: int) -> dict:
    """The requests `concurrent` at a time, each batch of them sent at once when the last ended."""
    cfg = embedded_runtime(cache_at_start="none", tail_s=0.0)
    tokens, elapsed, ttft, tpot = 0, 0.0, [], []
    for first in range(0, len(lengths), concurrent):
        group = lengths[first:first + concurrent]
        trace = Simulation(cfg, [model], {MODEL: np.zeros(len(group))}, "static", load_settings(environ={}),
                           prompts={MODEL: group}).run()
        g = trace.generation
        assert (trace.status == 200).all(), trace.status
        tokens += int(g.tokens.sum())
        elapsed += float(np.max(trace.latency))
        ttft += list(g.ttft * 1000.0)
        tpot += list(g.tpot * 1000.0)
    return {"tps": tokens / elapsed, "ttft": float(np.median(ttft)), "tpot": float(np.median(tpot))}


def _report(live: list[dict], simulated: list[dict], cal: Calibration) -> dict:
    labels = ["alone"] + [f"{c} at once" for c in LEVELS]
    rows, figures = [], []
    for label, x, s in zip(labels, live, simulated):
        rows.append([label, x["tps"], s["tps"], s["tps"] / x["tps"], x["tpot"], s["tpot"], s["tpot"] / x["tpot"],
                     x["ttft"], s["ttft"], s["ttft"] / x["ttft"]])
        for name, unit in (("tps", "tokens/s"), ("tpot", "ms"), ("ttft", "ms")):
            figures += [{"name": f"live {name} {label}", "value": round(x[name], 3), "unit": unit},
                        {"name": f"simulated {name} {label}", "value": round(s[name], 3), "unit": unit},
                        {"name": f"simulated/live {name} {label}", "value": round(s[name] / x[name], 3), "unit": "x"}]
    figures += [{"name": "fitted hand-off latency (TPOT alone)", "value": cal.hop_s * 1000, "unit": "ms"},
                {"name": "fitted CPU per item outside the steps (tokens/s at 16)", "value": cal.item_cpu_s * 1000,
                 "unit": "ms"}]
    print(f"fitted: hand-off {cal.hop_s * 1000:.2f} ms (from TPOT alone), CPU per item outside the steps "
          f"{cal.item_cpu_s * 1000:.2f} ms (from tokens/s at 16 at once); every other figure is out of sample")
    print(table(f"{MODEL}: live pipeline vs simulator, {NEW} new tokens, one replica per stage",
                ["requests", "live tok/s", "sim tok/s", "ratio", "live TPOT p50 ms", "sim TPOT", "ratio",
                 "live TTFT p50 ms", "sim TTFT", "ratio"], rows))
    write("simulator_generation", figures,
          conditions(model=MODEL, stages=STAGES, new_tokens=NEW, alone_prompts=ALONE, levels=list(LEVELS),
                     threads_per_replica=1, preset="embedded", calibration=f"sim/calibration/{MODEL}.json"))
    _plot(labels, live, simulated)
    return {"figures": figures}


def _plot(labels: list[str], live: list[dict], simulated: list[dict]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    x = np.arange(len(labels))
    for ax, (key, title) in zip(axes, (("tps", "tokens/s"), ("tpot", "TPOT p50 (ms)"), ("ttft", "TTFT p50 (ms)"))):
        ax.bar(x - 0.2, [r[key] for r in live], 0.4, label="live pipeline")
        ax.bar(x + 0.2, [r[key] for r in simulated], 0.4, label="simulator")
        ax.set_xticks(x, labels, rotation=20)
        ax.set_title(f"{MODEL}: {title}")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "simulator_generation.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
