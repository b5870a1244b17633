"""End-to-end latency of the 4-stage SmolLM2 pipeline on the embedded runtime against the unsplit
model in one process, on the same ShareGPT prompts, interleaved in one run.

Both sides compute with one thread (a stage replica's default), produce one token per prompt, and
are timed from the caller: the pipeline through the gateway, the entry function, four stage
replicas and the reply; the unsplit model as tokenise + forward + argmax. The unsplit model projects
only the last position through its 49,152-wide head (`logits_to_keep=1`), as the pipeline's last
stage does: both sides do the same work."""
from __future__ import annotations

import time

import numpy as np
import torch
from transformers import AutoTokenizer

from benchmarks.report import SERVING, conditions, mean_ci95, percentiles, scratch, table, verdict, write
from contracts.config import load_settings
from contracts.http_client import GatewayClient
from loadgen.sharegpt import first_prompts
from runtime import __main__ as control
from runtime.ports import free_port

MEASURES = SERVING + ("loadgen",)  # the code measured (benchmarks/freshness.py)

STAGES = 4


def _unsplit(settings):
    from models.sources import load_source
    source = load_source("smollm2", settings.models_dir / "_sources")
    tokenizer = AutoTokenizer.from_pretrained(source.tokenizer_dir)

    def run(prompt: str) -> tuple[int, float]:
        t0 = time.perf_counter()
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.inference_mode():
            token = int(source.model(input_ids=ids, logits_to_keep=1).logits[0, -1].argmax())
        return token, (time.perf_counter() - t0) * 1000.0
    return run


def main(count: int = 40, warmup: int = 5) -> dict:
    base = load_settings()
    with scratch("quart-bench-") as run_home:
        # Own state and ports, so a runtime the user has up is left alone; the user's models. Nothing
        # scales, so nothing is cached: a KeysManager loading zygotes would share the cores with the
        # requests measured. Nor do decode steps compile: every request here is a prefill, eager either
        # way, and the replicas' background compiles would take the cores for the first minutes (at
        # 47b8aa5 they overlapped the whole run: 1616 ms against 256 unsplit). Both sides in float32,
        # whatever the host's default dtype, and on one thread: a prefill on the idle cores (the
        # default) would hide the overhead this measures behind a second core.
        settings = base.replace(home=str(run_home), models=str(base.models_dir),
                                gateway_port=free_port(), redis_port=free_port(), keysmanager_port=free_port(),
                                policy="none", cache_stages="none", dtype="float32", compile=False, idle_cores="off")
        torch.set_num_threads(1)
        unsplit = _unsplit(settings)
        if control.up(settings, timeout=600) != 0:
            raise SystemExit("the embedded runtime did not come up")
        try:
            client = GatewayClient.for_settings(settings)
            prompts = first_prompts(count + warmup, seed=7)
            pipe_ms, local_ms, service_ms, queue_ms, mismatches = [], [], [], [], 0
            for i, prompt in enumerate(prompts):
                t0 = time.perf_counter()
                reply = client.invoke("smollm2", {"prompt": prompt, "max_new_tokens": 1})
                elapsed = (time.perf_counter() - t0) * 1000.0
                assert reply.status == 200, reply.body
                token, local = unsplit(prompt)
                answer = reply.json()
                if i < warmup:
                    continue
                mismatches += answer["token_ids"] != [token]
                pipe_ms.append(elapsed)
                local_ms.append(local)
                service_ms.append(sum(s["service_ms"] for s in answer["stages"]))
                queue_ms.append(sum(s["queue_ms"] for s in answer["stages"]))
        finally:
            control.down(settings)
    pipe, local = percentiles(pipe_ms), percentiles(local_ms)
    overhead = (pipe["p50"] - local["p50"]) / STAGES
    # Each prompt ran both ways back to back: the mean of the paired differences, with its interval,
    # decides the target (the median difference alone cannot say how sure it is).
    paired, half = mean_ci95([(p - u) / STAGES for p, u in zip(pipe_ms, local_ms)])
    met = verdict(paired, half, 3.0)
    non_compute = float(np.median(np.asarray(pipe_ms) - np.asarray(service_ms))) / STAGES
    rows = [["unsplit, one process", local["p50"], local["p99"]],
            ["4-stage pipeline over HTTP", pipe["p50"], pipe["p99"]]]
    print(table(f"SmolLM2, one token per prompt, {len(pipe_ms)} ShareGPT prompts (ms)",
                ["path", "p50 ms", "p99 ms"], rows))
    print(f"p50 overhead per stage: {overhead:.3f} ms; mean of paired differences {paired:.3f} ms "
          f"(95 % interval {paired - half:.3f}-{paired + half:.3f}; target <= 3 ms: {met})")
    print(f"median (latency - summed stage compute) per stage: {non_compute:.3f} ms; "
          f"median summed stage queue wait: {float(np.median(queue_ms)):.3f} ms; token mismatches: {mismatches}")
    figures = [
        {"name": "unsplit p50", "value": local["p50"], "unit": "ms"},
        {"name": "unsplit p99", "value": local["p99"], "unit": "ms"},
        {"name": "pipeline p50", "value": pipe["p50"], "unit": "ms"},
        {"name": "pipeline p99", "value": pipe["p99"], "unit": "ms"},
        {"name": "p50 overhead per stage", "value": round(overhead, 3), "unit": "ms"},
        {"name": "mean paired overhead per stage", "value": round(paired, 3), "unit": "ms",
         "ci95": [round(paired - half, 3), round(paired + half, 3)], "target": 3.0, "verdict": met},
        {"name": "median non-compute time per stage", "value": round(non_compute, 3), "unit": "ms"},
        {"name": "median summed queue wait", "value": round(float(np.median(queue_ms)), 3), "unit": "ms"},
        {"name": "token mismatches", "value": mismatches, "unit": "prompts"},
    ]
    write("pipeline_overhead", figures, conditions(
        prompts=len(pipe_ms), warmup=warmup, max_new_tokens=1, stages=STAGES, threads_per_side=1,
        dtype="float32", device="cpu", compiled_decode_steps=settings.compute.compiles,
        unsplit_head="logits_to_keep=1 (the last position only, as the last stage)",
        note="the pipeline path includes the gateway and entry function hops"))
    return {"pipeline": pipe, "unsplit": local, "overhead_per_stage_ms": overhead}


if __name__ == "__main__":
    main()
