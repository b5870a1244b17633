"""Decode steps compiled with torch.compile compute what the eager steps compute: the same greedy
tokens, logits within float32's rounding, for a batch of sequences at different lengths, through
every stage of a split model (random weights written by transformers' own config classes), across
the lengths where the compiled step reads keys in a new bucket, and in a family with sliding
windows and soft-capped logits."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from torch._dynamo.utils import counters

from contracts.paths import REPO_ROOT
from models.batched_decoder import BatchedDecoder, Step
from models.compiled_decode import LENGTH_BUCKET, CompiledDecode
from models.kv_cache import KVStore
from models.packed_linear import can_pack
from models.partition import partition
from models.sources import resolve
from models.stage_runner import StageRunner

PROMPTS = [[5, 17, 300, 42, 7, 99, 1000, 12, 31], [8, 9], [400, 3, 77, 12]]
# Past one length bucket, so the compiled step runs at two lengths of keys.
NEW = LENGTH_BUCKET - 4


def decode(chain: list[BatchedDecoder], new: int, prompts: list[list[int]] = PROMPTS,
           forced: list[list[int]] | None = None) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens of `prompts`, prefilled one by one and decoded together; each step's logits.
    With `forced`, each step is given those tokens instead of its own greedy ones."""
    stores = [KVStore(e.kv_shape(), 1 << 26) for e in chain]
    seqs = [[store.admit(str(i), len(p) + new) for store in stores] for i, p in enumerate(prompts)]
    tokens: list[list[int]] = []
    for i, prompt in enumerate(prompts):
        x = torch.tensor(prompt)
        for engine, seq in zip(chain, seqs[i]):
            x = engine.forward([Step(seq, x, 0)])[0]
        tokens.append([int(x.argmax())])
    logits = []
    for step in range(new - 1):
        fed = [f[step] for f in forced] if forced else [t[-1] for t in tokens]
        xs = [torch.tensor([t]) for t in fed]
        for k, engine in enumerate(chain):
            xs = engine.forward([Step(seqs[i][k], xs[i], seqs[i][k].length) for i in range(len(prompts))])
        logits.append(torch.stack(xs))
        for t, x in zip(tokens, xs):
            t.append(int(x.argmax()))
    return tokens, logits


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_compiled_decode_steps_generate_what_eager_steps_do(model_type, home_settings, tmp_path):
    manifest = partition(resolve(f"random-{model_type}", home_settings.models_dir / "_sources", seed=3), 2,
                         tmp_path / model_type)
    chain = [BatchedDecoder(StageRunner(manifest, i, i + 1, dtype="float32", prepack=False).modules)
             for i in range(manifest.num_stages)]
    expected, expected_logits = decode(chain, NEW)
    for engine in chain:
        engine.compiled = CompiledDecode(engine)
        engine.compiled.warm()
    got, logits = decode(chain, NEW)
    assert got == expected
    gap = max((a - b).abs().max().item() for a, b in zip(logits, expected_logits))
    assert gap <= 1e-3, gap


# Each dtype's share of the logits' range that the compiled steps may differ by: float32 sums in
# another order; bfloat16 rounds each layer's output.
PACKED_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.02}


@pytest.mark.parametrize("dtype", list(PACKED_TOLERANCE))
def test_packed_steps_compiled_one_engine_after_another_compute_what_eager_steps_do(dtype, home_settings, tmp_path):
    """Prepacked linears, as a CPU serves (bfloat16 where `auto` chooses it): one sequence's
    compiled step reads the plain weights, several sequences' the packed ones. The second stage
    compiles after the first has served compiled steps (with only the guards that tell graphs
    apart): its steps must run its own graphs. Each step is given the eager run's tokens, so the
    logits compare step by step (within PACKED_TOLERANCE of the logits' range, where a wrong graph
    or weight is off by the whole range)."""
    if not can_pack(torch.device("cpu"), getattr(torch, dtype)):
        pytest.skip(f"this CPU's oneDNN does not pack {dtype}")
    manifest = partition(resolve("random-llama", home_settings.models_dir / "_sources", seed=3), 2, tmp_path / "m")
    chain = [BatchedDecoder(StageRunner(manifest, i, i + 1, dtype=dtype).modules) for i in range(2)]
    runs = {}
    for prompts in (PROMPTS, PROMPTS[:1]):
        runs[len(prompts)] = decode(chain, NEW, prompts)
    chain[0].compiled = CompiledDecode(chain[0])
    chain[0].compiled.warm()
    decode(chain[:1], 4, PROMPTS[:1])  # the first stage serves compiled steps, the second is not compiled
    chain[1].compiled = CompiledDecode(chain[1])
    chain[1].compiled.warm()
    for batch, (tokens, expected) in runs.items():
        _, logits = decode(chain, NEW, PROMPTS[:batch], forced=tokens)
        scale = max(float(e.abs().max()) for e in expected)
        gap = max(float((a - b).abs().max()) for a, b in zip(logits, expected))
        assert gap <= PACKED_TOLERANCE[dtype] * scale, (batch, gap, scale)


def test_a_step_runs_compiled_on_the_thread_counts_compiled_for_and_eager_on_others(home_settings, tmp_path):
    """Dynamo guards on the thread count: a step on a count no graph was compiled for (the host's
    idle cores, CPU compensation) would compile inline, in the serving thread. It runs eager
    instead, and once that count is compiled too, each count runs its own graph, compiling nothing."""
    manifest = partition(resolve("random-llama", home_settings.models_dir / "_sources", seed=3), 1, tmp_path / "m")
    engine = BatchedDecoder(StageRunner(manifest, 0, 1, dtype="float32", prepack=False).modules)
    store = KVStore(engine.kv_shape(), 1 << 26)
    seq = store.admit("a", 20)
    engine.forward([Step(seq, torch.tensor([1, 2, 3]), 0)])
    step = Step(seq, torch.tensor([4]), 3)
    expected = engine.forward([step])[0]
    threads = torch.get_num_threads()
    engine.compiled = CompiledDecode(engine)
    engine.compiled.warm()
    try:
        torch.set_num_threads(threads + 1)
        assert not engine.runs_compiled([step]), "no graph for this count: the step must run eager"
        torch.testing.assert_close(engine.forward([step])[0], expected, rtol=1e-4, atol=1e-4)
        engine.compiled.warm([threads + 1])
        graphs = counters["stats"]["unique_graphs"]
        for n in (threads, threads + 1, threads):
            torch.set_num_threads(n)
            assert engine.runs_compiled([step]), n
            torch.testing.assert_close(engine.forward([step])[0], expected, rtol=1e-4, atol=1e-4)
        assert counters["stats"]["unique_graphs"] == graphs, "a serving step compiled"
    finally:
        torch.set_num_threads(threads)


def test_steps_that_are_not_all_decodes_stay_eager(home_settings, tmp_path):
    manifest = partition(resolve("random-llama", home_settings.models_dir / "_sources", seed=3), 1, tmp_path / "m")
    engine = BatchedDecoder(StageRunner(manifest, 0, 1, dtype="float32", prepack=False).modules)
    compiled = CompiledDecode(engine)
    store = KVStore(engine.kv_shape(), 1 << 26)
    a, b = store.admit("a", 20), store.admit("b", 20)
    decode_a, prefill_b = Step(a, torch.tensor([3]), 4), Step(b, torch.tensor([1, 2, 3]), 0)
    assert not compiled.serves([decode_a]), "nothing runs compiled before the compile is done"
    compiled.warm()
    assert compiled.serves([decode_a]) and not compiled.serves([decode_a, prefill_b])


def _nice(tid: int) -> int:
    """A thread's nice value, as the kernel holds it (field 19 of its stat line)."""
    stat = Path(f"/proc/self/task/{tid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[16])


def test_a_background_compile_waits_its_turn_then_runs_below_serving_and_so_does_its_compiler(home_settings, tmp_path):
    manifest = partition(resolve("random-llama", home_settings.models_dir / "_sources", seed=3), 1, tmp_path / "m")
    engine = BatchedDecoder(StageRunner(manifest, 0, 1, dtype="float32", prepack=False).modules)
    compiled = CompiledDecode(engine)
    turn = threading.Event()
    ours = {p.pid for p in psutil.Process().children(recursive=True)}  # the session's redis-server, say

    def new_children() -> list[psutil.Process]:
        return [p for p in psutil.Process().children(recursive=True) if p.pid not in ours]
    lowered = []  # the compile thread's name and nice as it starts its work, read in that thread:
    # with inductor's caches warm the compile takes a fraction of a second, too short to sample

    def prepare() -> None:
        tid = threading.get_native_id()
        lowered.append((Path(f"/proc/self/task/{tid}/comm").read_text().strip(), _nice(tid)))
    thread = compiled.warm_in_background(nice=19, may_start=turn.is_set, prepare=prepare)
    time.sleep(1.0)
    assert thread.is_alive() and not compiled.ready
    assert not lowered and _nice(thread.native_id) == 0 and not new_children(), "nothing started before its turn"
    turn.set()
    children = {}
    while thread.is_alive():
        with contextlib.suppress(psutil.Error):  # a child may end between the listing and the read
            for child in new_children():
                children[child.pid] = child.nice()
        time.sleep(0.05)
    assert compiled.ready, "the compile failed (see the log)"
    assert lowered == [("quart-compile", 19)]
    assert all(n == 19 for n in children.values()), children
    assert os.getpriority(os.PRIO_PROCESS, 0) == 0, "the serving thread keeps its priority"


def test_a_failed_compile_worker_leaves_the_whole_compile_to_the_replica(home_settings, tmp_path, caplog):
    manifest = partition(resolve("random-llama", home_settings.models_dir / "_sources", seed=3), 1, tmp_path / "m")
    compiled = CompiledDecode(BatchedDecoder(StageRunner(manifest, 0, 1, dtype="float32", prepack=False).modules))

    def prepare() -> None:
        raise TypeError("a worker's programming error")  # as fill_cache given an int (f85ea7a)
    compiled.warm_in_background(prepare=prepare).join(timeout=600)
    assert compiled.ready, "the replica's own compile did not run after the worker failed"
    assert "preparing the compile failed" in caplog.text and "a worker's programming error" in caplog.text



# A fresh process compiling a stage's decode step, as a replica does after the worker: how often
# inductor's caches answered (this process's own in-memory ones would answer a test here).
_COMPILE_AND_COUNT = """
import json, sys, torch
from torch._dynamo.utils import counters
from models.compiled_decode import CompiledDecode
from models.manifest import Manifest
from models.stage_runner import StageRunner
CompiledDecode(StageRunner(Manifest.load(sys.argv[1]), 0, 1, dtype="float32", prepack=False).batched()).warm([1, 2])
print(json.dumps(dict(counters["inductor"])))
"""


def test_a_worker_process_fills_the_caches_that_the_replica_then_compiles_from(home_settings, tmp_path, monkeypatch,
                                                                               caplog):
    from models.compile_worker import fill_cache

    manifest = partition(resolve("random-llama", home_settings.models_dir / "_sources", seed=3), 1, tmp_path / "m")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # empty: nothing compiled yet
    assert not fill_cache(str(tmp_path / "nowhere"), 0, 1, "float32", [1], False)
    assert "the compile worker failed" in caplog.text
    assert fill_cache(str(manifest.directory), 0, 1, "float32", [1, 2], False)
    done = subprocess.run([sys.executable, "-c", _COMPILE_AND_COUNT, str(manifest.directory)], cwd=REPO_ROOT,
                          capture_output=True, check=True)
    counts = json.loads(done.stdout.decode().splitlines()[-1])
    assert counts.get("fxgraph_cache_hit", 0) >= 2 and not counts.get("fxgraph_cache_miss"), counts


def test_a_compile_worker_dies_with_its_replica(home_settings, tmp_path):
    manifest = partition(resolve("random-llama", home_settings.models_dir / "_sources", seed=3), 1, tmp_path / "m")
    replica = subprocess.Popen([sys.executable, "-c", "import sys; from models.compile_worker import fill_cache; "
                                "fill_cache(sys.argv[1], 0, 1, 'float32', [1], False)", str(manifest.directory)],
                               cwd=REPO_ROOT, env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")})
    deadline = time.monotonic() + 60
    while not (workers := psutil.Process(replica.pid).children()):
        assert time.monotonic() < deadline, "no worker started"
        time.sleep(0.05)
    replica.kill()
    replica.wait()
    gone, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, "the worker outlived its replica"
