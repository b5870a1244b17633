"""Serving steps while the same process compiles its decode step in the background, as a replica
not forked from a compiled zygote does (`models/compiled_decode.py`: a thread of its own at nice
19): the whole SmolLM2 in one engine, 4 sequences decoding eagerly on one thread, each step
followed by a pause (`--gap-ms`, the time a replica waits for its next items), the host otherwise
quiet. Three arms, each in a process of its own with an empty inductor cache (a node that has not
compiled this model):

  worker     as a replica compiles: a process of its own fills inductor's caches first
             (`models/compile_worker.py`), then the compile in this process parks during turns
  turns      each step is a serving turn (`models/serving_first.py`): the compile parks during it
  no turns   the compile's thread takes Python's lock whenever it can, with no profile hook
             (the code before serving_first.py)

    python -m benchmarks compile_beside_serving [--gap-ms 20] [--limit-s 600]

Per arm: the steps' times for 20 s before the compile starts and while it runs; the seconds until
steps run compiled, and the part of them the serving process compiled (none if it did not end
within --limit-s)."""
from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext

import torch

from benchmarks.report import SERVING, conditions, percentiles, table, write
from contracts.config import load_settings

MEASURES = SERVING  # the code measured (benchmarks/freshness.py)

MODEL, SEQUENCES, PROMPT, BEFORE_S = "smollm2", 4, 16, 20.0
# Each arm: whether steps are serving turns; whether a worker process fills the caches first.
ARMS = {"worker": (True, True), "turns": (True, False), "no turns": (False, False)}


def _stepper(gated: bool, gap_s: float) -> tuple[Callable[[], float], object, object]:
    """One decode step of SEQUENCES sequences (ms), as a turn when `gated`; the engine; the manifest."""
    from models.batched_decoder import BatchedDecoder, Step
    from models.fetch import ensure_manifest
    from models.kv_cache import KVStore
    from models.serving_first import SERVING_FIRST
    from models.stage_runner import StageRunner

    settings = load_settings()
    manifest = ensure_manifest(settings, MODEL, tokenizer=False)
    engine = BatchedDecoder(StageRunner(manifest, 0, manifest.num_stages, "cpu", settings.compute.dtype,
                                        prepack=settings.compute.prepack).modules)
    capacity = 256  # tokens a sequence decodes before the batch starts again: its steps stay alike
    state: dict = {}

    def admit() -> None:
        store = KVStore(engine.kv_shape(), SEQUENCES * (PROMPT + capacity) * engine.kv_shape().bytes_per_token)
        seqs = [store.admit(str(i), PROMPT + capacity) for i in range(SEQUENCES)]
        state["seqs"] = seqs
        state["tokens"] = [int(engine.forward([Step(s, torch.arange(5, 5 + PROMPT), 0)])[0].argmax()) for s in seqs]

    def step() -> float:
        if "seqs" not in state or state["seqs"][0].length >= PROMPT + capacity - 1:
            admit()
        seqs, tokens = state["seqs"], state["tokens"]
        t0 = time.perf_counter()
        with SERVING_FIRST.turn() if gated else nullcontext():
            out = engine.forward([Step(s, torch.tensor([t]), s.length) for s, t in zip(seqs, tokens)])
        took = (time.perf_counter() - t0) * 1000.0
        state["tokens"] = [int(x.argmax()) for x in out]
        time.sleep(gap_s)
        return took
    return step, engine, manifest


def arm(gated: bool, worker: bool, gap_ms: float, limit_s: float) -> dict:
    """This process's run of one arm: steps before and while the compile runs."""
    from models.compile_worker import fill_cache
    from models.compiled_decode import compile_in_background
    from models.serving_first import SERVING_FIRST

    if not gated:  # the code before serving_first.py: no profile hook on the compiling thread either
        SERVING_FIRST.yield_to_serving = lambda: None
    torch.set_num_threads(1)
    step, engine, manifest = _stepper(gated, gap_ms / 1000.0)
    before, t0 = [], time.monotonic()
    while time.monotonic() - t0 < BEFORE_S:
        before.append(step())
    settings = load_settings()
    prepare = (functools.partial(fill_cache, str(manifest.directory), 0, manifest.num_stages, settings.compute.dtype, (1,),
                                 settings.compute.prepack) if worker else lambda: None)
    compile_in_background(engine, settings.compute.compile_nice, prepare=prepare)
    if engine.compiled is None:
        raise SystemExit("no C++ compiler on this host: nothing compiles")
    during, t0 = [], time.monotonic()
    while not engine.compiled.ready and time.monotonic() - t0 < limit_s:
        during.append(step())
        print(f"\r  {len(during)} steps while compiling, {time.monotonic() - t0:.0f} s", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    ready_s = time.monotonic() - t0 if engine.compiled.ready else None
    return {"before_ms": before, "during_ms": during, "compile_s": engine.compiled.compile_s, "ready_s": ready_s,
            "dtype": str(engine.dtype).removeprefix("torch.")}


def _summary(ms: list[float]) -> dict:
    p = percentiles(ms)
    return {"median": p["p50"], "p99": p["p99"], "max": max(ms), "steps": p["n"]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks compile_beside_serving", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gap-ms", type=float, default=20.0, help="the pause after each step")
    parser.add_argument("--limit-s", type=float, default=600.0, help="how long an arm waits for its compile")
    parser.add_argument("--arm", choices=list(ARMS), help=argparse.SUPPRESS)  # one arm, in this process
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.arm:
        result = arm(*ARMS[args.arm], args.gap_ms, args.limit_s)
        with open(args.out, "w") as f:
            json.dump(result, f)
        # A compile still running at the limit holds C++ threads that abort the interpreter's
        # exit (SIGABRT, "terminate called without an active exception"); the result is written.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    runs = {}
    for name in ARMS:
        print(f"arm: {name}", flush=True)
        with tempfile.TemporaryDirectory(prefix="quart-compile-") as tmp:
            out = os.path.join(tmp, "arm.json")
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(tmp, "inductor")}
            subprocess.run([sys.executable, "-m", "benchmarks", "compile_beside_serving", "--arm", name, "--out", out,
                            "--gap-ms", str(args.gap_ms), "--limit-s", str(args.limit_s)], env=env, check=True)
            with open(out) as f:
                runs[name] = json.load(f)
    return report(runs, args.gap_ms, args.limit_s)


def report(runs: dict, gap_ms: float, limit_s: float) -> dict:
    rows, figures = [], []
    for name, run in runs.items():
        before, during = _summary(run["before_ms"]), _summary(run["during_ms"])
        compile_s, ready_s = run["compile_s"], run["ready_s"]
        rows.append([name, before["median"], during["median"], during["p99"], during["max"],
                     during["max"] / before["median"], "-" if ready_s is None else round(ready_s, 1),
                     "-" if compile_s is None else round(compile_s, 1)])
        for phase, s in (("before the compile", before), ("while it compiles", during)):
            figures += [{"name": f"{name}: step {stat} {phase}", "value": round(s[stat], 2), "unit": "ms"}
                        for stat in ("median", "p99", "max")]
            figures.append({"name": f"{name}: steps {phase}", "value": s["steps"], "unit": "steps"})
        figures += [{"name": f"{name}: longest step while compiling / median before", "unit": "x",
                     "value": round(during["max"] / before["median"], 2)},
                    {"name": f"{name}: compiled after", "unit": "s",
                     "value": None if ready_s is None else round(ready_s, 1)},
                    {"name": f"{name}: compile in the serving process", "unit": "s",
                     "value": None if compile_s is None else round(compile_s, 1)}]
    print(table(f"{MODEL} whole, {SEQUENCES} sequences, eager steps on one thread, {gap_ms:g} ms between steps (ms)",
                ["arm", "median before", "median while compiling", "p99 while", "max while", "max / median before",
                 "compiled after s", "in-process s"], rows))
    path = write("compile_beside_serving", figures,
                 conditions(model=MODEL, sequences=SEQUENCES, prompt_tokens=PROMPT, gap_ms=gap_ms, limit_s=limit_s,
                            threads=1, dtype=next(iter(runs.values()))["dtype"], inductor_cache="empty per arm"))
    print(f"wrote {path}")
    return runs
