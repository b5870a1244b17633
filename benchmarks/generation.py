"""Generation through the 4-stage pipeline on the embedded runtime against the unsplit
transformers model in this process, on the same ShareGPT prompts, in one run.

    python -m benchmarks generation                  # SmolLM2 (real weights)
    python -m benchmarks generation --model llama1b  # a random-weights LLaMA of about 1 B parameters
    python -m benchmarks generation --model qwen2    # random weights in each family's shape (qwen2,
                                                     # qwen3, mistral, gemma2, gemma3, phi3), ~0.5 B

One at a time, interleaved: the pipeline's time to first token (TTFT) and time per output token
(TPOT) as its responses report them, against unsplit `generate(use_cache=True)` (TTFT: its prefill,
a forward over the prompt; TPOT: the rest of `generate` per further token). Then throughput at
1, 4, 8 and 16 concurrent requests, against the unsplit model run sequentially and against
unsplit `generate()` on a left-padded batch of the same prompts. Every stage replica and the
unsplit model compute with one thread; the pipeline's four replicas share this machine's cores.
Greedy decoding, a fixed number of new tokens (end of text ignored on both sides)."""
from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import yaml

from benchmarks.report import RESULTS, conditions, percentiles, table, write
from contracts.config import Settings, load_settings
from contracts.http_client import GatewayClient
from contracts.paths import REPO_ROOT
from loadgen.sharegpt import first_prompts
from runtime import __main__ as control
from runtime.ports import free_port

STAGES = 4
LLAMA_1B = {"hidden_size": 2048, "num_hidden_layers": 20, "intermediate_size": 5632, "num_attention_heads": 32,
            "num_key_value_heads": 4, "head_dim": 64}
# Each family at a size this machine serves in minutes (random weights, the tokenizer and
# vocabulary of SmolLM2): Qwen2.5-0.5B's and Qwen3-0.6B's own shapes, Gemma 3 1B's, and Mistral,
# Gemma 2 and Phi-3 scaled down to about 0.5 B with their own proportions and quirks.
FAMILY_SHAPES = {
    "qwen2": ("qwen2", {"hidden_size": 896, "num_hidden_layers": 24, "intermediate_size": 4864,
                        "num_attention_heads": 14, "num_key_value_heads": 2, "tie_word_embeddings": True}),
    "qwen3": ("qwen3", {"hidden_size": 1024, "num_hidden_layers": 28, "intermediate_size": 3072,
                        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128}),
    "mistral": ("mistral", {"hidden_size": 1024, "num_hidden_layers": 16, "intermediate_size": 3584,
                            "num_attention_heads": 16, "num_key_value_heads": 4, "sliding_window": 4096}),
    "gemma2": ("gemma2", {"hidden_size": 1024, "num_hidden_layers": 16, "intermediate_size": 4096,
                          "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 128,
                          "sliding_window": 4096, "query_pre_attn_scalar": 128}),
    "gemma3": ("gemma3_text", {"hidden_size": 1152, "num_hidden_layers": 26, "intermediate_size": 6912,
                               "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
                               "sliding_window": 512, "sliding_window_pattern": 6, "query_pre_attn_scalar": 256}),
    "phi3": ("phi3", {"hidden_size": 1024, "num_hidden_layers": 16, "intermediate_size": 4096,
                      "num_attention_heads": 16, "num_key_value_heads": 16}),
}
SOURCES = {"smollm2": ("smollm2", None), "llama1b": ("random-llama", LLAMA_1B),
           **{name: (f"random-{t}", shape) for name, (t, shape) in FAMILY_SHAPES.items()}}
MODELS = {"smollm2": {"prompts": 10, "levels": (1, 4, 8, 16)},
          "llama1b": {"prompts": 3, "levels": (1, 4, 8, 16)},
          **{name: {"prompts": 3, "levels": (1, 4, 8)} for name in FAMILY_SHAPES}}


class Unsplit:
    """The unsplit model, timed the way the pipeline is: TTFT, TPOT and batched throughput."""

    def __init__(self, settings: Settings, model: str) -> None:
        from models.sources import load_source
        source, config = SOURCES[model]
        self.source = load_source(source, settings.models_dir / "_sources", config)
        self.model = self.source.model
        # End of text ignored, as the pipeline's requests ask: generate() always makes `new` tokens.
        self.model.generation_config.eos_token_id = None

    @torch.inference_mode()
    def one(self, ids: list[int], new: int) -> tuple[float, float, list[int]]:
        """(TTFT ms, TPOT ms, tokens) of `generate(use_cache=True)`, greedy, `new` tokens."""
        x = torch.tensor([ids])
        t0 = time.perf_counter()
        self.model(input_ids=x, logits_to_keep=1)
        prefill = time.perf_counter() - t0
        t1 = time.perf_counter()
        out = self.model.generate(x, max_new_tokens=new, do_sample=False, use_cache=True,
                                  pad_token_id=0)
        total = time.perf_counter() - t1
        return prefill * 1000.0, (total - prefill) * 1000.0 / (new - 1), out[0, len(ids):].tolist()

    @torch.inference_mode()
    def padded_batch(self, prompts: list[list[int]], new: int) -> float:
        """Tokens per second of one `generate()` over the prompts as a left-padded batch."""
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        t0 = time.perf_counter()
        self.model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                            use_cache=True, pad_token_id=0)
        return len(prompts) * new / (time.perf_counter() - t0)


def _stack(home: Path, model: str) -> str:
    """The stack file: the repository's for SmolLM2; for the others, an entry and four stages."""
    if model == "smollm2":
        return str(REPO_ROOT / "stack.yml")
    identity = {"QUART_MODEL": model, "QUART_MODEL_SOURCE": SOURCES[model][0]}  # partitioned by `running`
    functions = {model: {"lang": "python3-http", "handler": str(REPO_ROOT / "functions/entry"), "image": "quart/entry:0.1.0",
                         "environment": identity}}
    for i in range(STAGES):
        functions[f"{model}-s{i}"] = {"lang": "python3-http", "handler": str(REPO_ROOT / "functions/stage"), "image": "quart/stage:0.1.0",
                                      "environment": {**identity, "QUART_STAGES": str(i)}}
    path = home / "stack.yml"
    path.write_text(yaml.safe_dump({"version": 1.0, "provider": {"name": "openfaas", "gateway": "http://127.0.0.1:8080"},
                                    "functions": functions}))
    return str(path)


def pipeline_request(client: GatewayClient, model: str, text: str, new: int) -> dict:
    reply = client.invoke(model, {"prompt": text, "max_new_tokens": new, "ignore_eos": True})
    assert reply.status == 200, reply.body
    return reply.json()


@contextmanager
def running(model: str, new: int) -> Iterator[Settings]:
    """The embedded runtime serving `model` in 4 stages, one replica each and no autoscaler, on
    ports of its own; stopped and its home removed afterwards."""
    base = load_settings()
    run_home = Path(tempfile.mkdtemp(prefix="quart-bench-"))
    settings = base.replace(home=str(run_home), models=str(base.models_dir), gateway_port=free_port(),
                            redis_port=free_port(), keysmanager_port=free_port(), policy="none",
                            stack_file=_stack(run_home, model), max_new_tokens=max(new, base.limits.max_new_tokens),
                            request_timeout_s=600.0, cache_stages="none", admit_wait_s=0.0)
    if model != "smollm2":
        from models.partition import ensure_partitioned
        source, config = SOURCES[model]
        ensure_partitioned(settings.models_dir, model, STAGES, source, random_config=config)
    try:
        if control.up(settings, timeout=900) != 0:
            raise SystemExit(f"the embedded runtime did not come up; see {run_home}/logs")
        pipeline_request(GatewayClient(settings.gateway.url, timeout=900), model, "warm up", 4)
        yield settings
    finally:
        control.down(settings)
        shutil.rmtree(run_home, ignore_errors=True)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    spec, new = MODELS[args.model], args.new_tokens
    torch.set_num_threads(1)
    levels = spec["levels"]
    texts = first_prompts(spec["prompts"] + max(levels), seed=21, max_chars=300)
    with running(args.model, new) as settings:
        unsplit = Unsplit(settings, args.model)
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(unsplit.source.tokenizer_dir)
        client = GatewayClient(settings.gateway.url, timeout=900)
        alone = _one_at_a_time(client, unsplit, tokenizer, args.model, texts[:spec["prompts"]], new)
        throughput = _throughput(client, unsplit, tokenizer, args.model, texts[spec["prompts"]:], levels, new)
    return _report(args.model, alone, throughput, new, levels)


def _one_at_a_time(client, unsplit: Unsplit, tokenizer, model: str, texts: list[str], new: int) -> dict:
    out = {"pipe_ttft": [], "pipe_tpot": [], "ref_ttft": [], "ref_tpot": [], "mismatches": 0, "ref_tps": []}
    for i, text in enumerate(texts):
        print(f"  one at a time: prompt {i + 1}/{len(texts)}", flush=True)
        answer = pipeline_request(client, model, text, new)
        ttft, tpot, tokens = unsplit.one(tokenizer(text)["input_ids"], new)
        out["mismatches"] += answer["token_ids"] != tokens
        out["pipe_ttft"].append(answer["ttft_ms"])
        out["pipe_tpot"].append(answer["tpot_ms"])
        out["ref_ttft"].append(ttft)
        out["ref_tpot"].append(tpot)
        out["ref_tps"].append(new / ((ttft + tpot * (new - 1)) / 1000.0))
    return out


def _throughput(client, unsplit: Unsplit, tokenizer, model: str, texts: list[str], levels, new: int) -> list[dict]:
    rows = []
    for c in levels:
        print(f"  throughput at {c} concurrent", flush=True)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(c) as pool:
            answers = list(pool.map(lambda t: pipeline_request(client, model, t, new), texts[:c]))
        wall = time.perf_counter() - t0
        batched = unsplit.padded_batch([tokenizer(t)["input_ids"] for t in texts[:c]], new)
        rows.append({"concurrency": c, "pipeline_tps": sum(len(a["token_ids"]) for a in answers) / wall,
                     "pipeline_tpot_p50": float(np.median([a["tpot_ms"] for a in answers])),
                     "pipeline_ttft_p50": float(np.median([a["ttft_ms"] for a in answers])),
                     "unsplit_batch_tps": batched})
    return rows


def _report(model: str, alone: dict, rows: list[dict], new: int, levels) -> dict:
    pipe_tpot, ref_tpot = percentiles(alone["pipe_tpot"]), percentiles(alone["ref_tpot"])
    pipe_ttft, ref_ttft = percentiles(alone["pipe_ttft"]), percentiles(alone["ref_ttft"])
    sequential = float(np.median(alone["ref_tps"]))
    tpot_ratio, ttft_ratio = pipe_tpot["p50"] / ref_tpot["p50"], pipe_ttft["p50"] / ref_ttft["p50"]
    print(table(f"{model}, one request at a time, {new} new tokens, {pipe_tpot['n']} ShareGPT prompts",
                ["path", "TTFT p50 ms", "TPOT p50 ms", "TPOT p99 ms"],
                [["unsplit generate(use_cache=True)", ref_ttft["p50"], ref_tpot["p50"], ref_tpot["p99"]],
                 ["4-stage pipeline", pipe_ttft["p50"], pipe_tpot["p50"], pipe_tpot["p99"]]]))
    print(f"TPOT ratio {tpot_ratio:.2f}x (target <= 1.3x), TTFT ratio {ttft_ratio:.2f}x (target <= 1.3x), "
          f"token mismatches {alone['mismatches']}")
    print(table("throughput (tokens/s)", ["concurrent", "pipeline", "vs sequential unsplit", "unsplit padded batch",
                                          "pipeline TPOT p50 ms"],
                [[r["concurrency"], r["pipeline_tps"], r["pipeline_tps"] / sequential, r["unsplit_batch_tps"],
                  r["pipeline_tpot_p50"]] for r in rows]))
    print(f"sequential unsplit: {sequential:.2f} tokens/s")
    figures = [
        {"name": "pipeline TTFT p50", "value": pipe_ttft["p50"], "unit": "ms"},
        {"name": "unsplit prefill (TTFT) p50", "value": ref_ttft["p50"], "unit": "ms"},
        {"name": "pipeline TPOT p50", "value": pipe_tpot["p50"], "unit": "ms"},
        {"name": "pipeline TPOT p99", "value": pipe_tpot["p99"], "unit": "ms"},
        {"name": "unsplit generate TPOT p50", "value": ref_tpot["p50"], "unit": "ms"},
        {"name": "TPOT ratio pipeline/unsplit", "value": round(tpot_ratio, 3), "unit": "x"},
        {"name": "TTFT ratio pipeline/unsplit", "value": round(ttft_ratio, 3), "unit": "x"},
        {"name": "token mismatches alone", "value": alone["mismatches"], "unit": "prompts"},
        {"name": "unsplit sequential throughput", "value": round(sequential, 3), "unit": "tokens/s"},
    ]
    for r in rows:
        c = r["concurrency"]
        figures += [
            {"name": f"pipeline throughput at {c}", "value": round(r["pipeline_tps"], 3), "unit": "tokens/s"},
            {"name": f"pipeline/sequential unsplit at {c}", "value": round(r["pipeline_tps"] / sequential, 3), "unit": "x"},
            {"name": f"unsplit padded batch throughput at {c}", "value": round(r["unsplit_batch_tps"], 3),
             "unit": "tokens/s"},
            {"name": f"pipeline TPOT p50 at {c}", "value": round(r["pipeline_tpot_p50"], 3), "unit": "ms"},
            {"name": f"pipeline TTFT p50 at {c}", "value": round(r["pipeline_ttft_p50"], 3), "unit": "ms"},
        ]
    name = "generation" if model == "smollm2" else f"generation_{model}"
    source, config = SOURCES[model]
    write(name, figures, conditions(model=model, source=source, shape=config, stages=STAGES, new_tokens=new,
                                    prompts=pipe_tpot["n"], levels=list(levels), threads_per_replica=1,
                                    unsplit_threads=1, dtype="float32",
                                    decoding="greedy, end of text ignored", max_batch=load_settings().batching.max_batch))
    _plot(name, model, rows, sequential, ref_tpot["p50"])
    return {"figures": figures}


def _plot(name: str, model: str, rows: list[dict], sequential: float, ref_tpot: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    c = [r["concurrency"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(c, [r["pipeline_tps"] for r in rows], "o-", label="4-stage pipeline")
    a.plot(c, [r["unsplit_batch_tps"] for r in rows], "s--", label="unsplit generate(), padded batch")
    a.axhline(sequential, color="grey", linestyle=":", label="unsplit, sequential")
    a.set(xlabel="concurrent requests", ylabel="tokens/s", title=f"{model}: throughput")
    a.legend()
    b.plot(c, [r["pipeline_tpot_p50"] for r in rows], "o-", label="4-stage pipeline")
    b.axhline(ref_tpot, color="grey", linestyle=":", label="unsplit, alone")
    b.set(xlabel="concurrent requests", ylabel="TPOT p50 (ms)", title=f"{model}: time per output token")
    b.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
