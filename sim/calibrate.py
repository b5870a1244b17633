"""Measures what batched steps of a generative model's real stages cost on this machine and writes
the simulator's calibration of it (sim/calibration/<model>.json).

    python -m sim.calibrate                    # SmolLM2 in 4 stages, one thread per stage
    python -m sim.calibrate --model llama1b    # a partition that is already there (the generation benchmark makes it)

Each stage alone, as a replica holds it (the served dtype, prepacked or int8 weights as
configured) and on a replica's threads (QUART_THREADS, 1 by default): decode batches of 1 to 16
requests at two context lengths, prefills of 16 to 256 tokens, and mixed batches, all eager; and
where a replica's decode steps compile (QUART_COMPILE), the decode batches again through the
compiled step, fitted apart (a replica runs only decode-only batches compiled). The cost model's
coefficients are fitted to them (sim.step_cost). Prompt lengths are ShareGPT prompts through the
model's tokenizer. Prefills run on the replica's own threads here, as under load; alone, a
replica's prefill takes the host's idle cores too (QUART_IDLE_CORES), which this does not model.
Takes about a minute for SmolLM2, and each stage's compile on top (tens of seconds with
inductor's cache warm)."""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from contracts.config import ComputeConfig, load_settings
from loadgen.sharegpt import first_prompts
from models.batched_decoder import BatchedDecoder
from models.batched_decoder import Step as EngineStep
from models.kv_cache import KVStore
from models.manifest import Manifest
from sim.step_cost import CALIBRATIONS, Calibration, Step, StepCost

DECODES = [[(1, ctx)] * b for ctx in (32, 256) for b in (1, 2, 3, 4, 8, 12, 16)]
PREFILLS = [[(p, 0)] for p in (16, 64, 128, 256)]
MIXED = [[(64, 0)] + [(1, 128)] * 7, [(32, 0), (48, 0)] + [(1, 64)] * 4]
REPEATS = 5
PROMPTS = 200


def measure(engine: BatchedDecoder, steps: list[Step], repeats: int = REPEATS, compiled: bool = False) -> float:
    """Median seconds of one forward over `steps`, each request with its own cache at its position,
    eager or through the engine's compiled decode step."""
    store = KVStore(engine.kv_shape(), engine.kv_shape().bytes_per_token * sum(s + t for t, s in steps))
    seqs = [store.admit(f"r{i}", start + tokens) for i, (tokens, start) in enumerate(steps)]
    inputs = [_inputs(engine, tokens) for tokens, _ in steps]
    times = []
    for _ in range(repeats + 1):
        batch = [EngineStep(seq, x, start) for seq, x, (_, start) in zip(seqs, inputs, steps)]
        t0 = time.perf_counter()
        engine.forward(batch, compiled=compiled)
        times.append(time.perf_counter() - t0)
    return float(np.median(times[1:]))   # the first warms the kernels up


def _inputs(engine: BatchedDecoder, tokens: int) -> torch.Tensor:
    if engine.embed is not None:
        return torch.randint(0, engine.embed.num_embeddings, (tokens,))
    return torch.randn(tokens, engine.width)


def calibrate(manifest: Manifest, progress: bool = True, compute: ComputeConfig | None = None) -> Calibration:
    """Every stage's steps measured and fitted, as `compute` (the configuration's by default) has a
    replica hold and run them."""
    from models.compiled_decode import compile_here
    from models.stage_runner import StageRunner
    compute = compute or load_settings().compute
    torch.set_num_threads(compute.threads)
    costs, kv, errors, compiled, dtype = [], [], [], [], torch.float32
    for i in range(manifest.num_stages):
        runner = StageRunner(manifest, i, i + 1, "cpu", compute.dtype, prepack=compute.prepack, quantize=compute.quantize)
        engine, dtype = runner.batched(), runner.dtype
        samples = [(steps, measure(engine, steps)) for steps in DECODES + PREFILLS + MIXED]
        if progress and compute.compiles:
            print(f"  stage {i}: compiling its decode step", flush=True)
        fast = compute.compiles and compile_here(engine, [compute.threads]) is not None
        decodes = [(steps, measure(engine, steps, compiled=True)) for steps in DECODES] if fast else []
        cost = StepCost.fit(samples, decodes)
        served = decodes + samples[len(DECODES):] if decodes else samples   # each batch as a replica runs it
        errors.append(float(np.median([abs(cost.batch_s(s) / t - 1) for s, t in served])))
        costs.append(cost)
        compiled.append(fast)
        kv.append(engine.kv_shape().bytes_per_token)
        if progress:
            sixteen, prompt = served[DECODES.index([(1, 32)] * 16)][1], samples[len(DECODES) + PREFILLS.index([(256, 0)])][1]
            print(f"  stage {i}: decode 1 at 32: {served[0][1] * 1000:.1f} ms, 16 at 32: {sixteen * 1000:.1f} ms"
                  f"{' (compiled)' if fast else ''}, prefill 256: {prompt * 1000:.1f} ms; "
                  f"fit median error {errors[-1]:.1%}", flush=True)
    width = manifest.config_object().hidden_size
    return Calibration(manifest.model, tuple(costs), tuple(kv), width * dtype.itemsize, tuple(s.bytes for s in manifest.stages),
                       tuple(_prompt_tokens(manifest)),
                       {"cpu": platform.machine(), "cores": os.cpu_count(),
                        "threads": compute.threads, "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch."),
                        "prepack": compute.prepack, "quantize": compute.quantize or None,
                        "compiled_decode_steps": compiled, "stages": manifest.num_stages,
                        "fit_median_relative_error": [round(e, 4) for e in errors],
                        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})


def _prompt_tokens(manifest: Manifest) -> list[int]:
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(manifest.tokenizer_path())
    return [len(tokenizer(text)["input_ids"]) for text in first_prompts(PROMPTS, seed=7)]


def main(argv: list[str] | None = None) -> Calibration:
    p = argparse.ArgumentParser(prog="python -m sim.calibrate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--stages", type=int, default=4, help="how the model is split (made if it is not there)")
    p.add_argument("--out", type=Path, default=None, help=f"default: {CALIBRATIONS}/<model>.json")
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    from models.partition import ensure_partitioned
    manifest = ensure_partitioned(load_settings().models_dir, a.model, a.stages)
    result = calibrate(manifest)
    out = a.out or CALIBRATIONS / f"{a.model}.json"
    result.save(out)
    print(f"calibration: {out}")
    return result


if __name__ == "__main__":
    main()
