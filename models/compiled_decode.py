"""A stage's decode steps (every sequence in the batch one new token) through one function
compiled with torch.compile's inductor: the family's own decoder layers (`BatchedDecoder`), with
attention reading the paged KV pools by slot (`PagedCall`), the linear layers as the replica holds
them (`models/packed_linear.py`: up to a few sequences, inductor's own reductions over the plain
weights, which read each weight once for the whole batch; past them, the oneDNN-packed weight as
one opaque kernel in the graph), and the C++ wrapper, which calls the kernels without Python
between them. Once compiled, a step checks only the guards that have told its graphs apart
(`CompiledDecode.forward`). Lengths are dynamic; batch sizes take a graph each up to a few
sequences, a batch padded to the next such size (`models/decode_batches.py`), and one graph for
every larger size. A compile traces them all: on the 2-core AVX2 EPYC, one 11-layer SmolLM2 stage
in float32 on one thread compiled its five graphs in 181 s with inductor's cache empty and 53 s
with it warm, where the two graphs it had before (one sequence, any other size) took 41 s warm;
its steps at 2 and 4 sequences went from 24.1 and 30.0 ms to 14.0 and 16.9 (keys at 128
positions), 8 took 24.2, and 1 and 16 stayed as they were (11.3; 47-49).

Inductor's freezing is not used: it would pack a second copy of every weight (the eager prefills
need theirs), and it compiled one SmolLM2 stage in 100 s every time where this took 23 s with
inductor's on-disk cache warm (110 with it empty; 31 and 137 s since one-row steps read their
weights in row blocks, `models/packed_linear.py`), for the same step time (measured on a 2-core
Xeon with AMX, one 11-layer stage in bfloat16, one thread: 11.4, 13.3 and 22.2 ms a step at 1, 4
and 16 sequences, against 11.2, 13.3 and 20.8 frozen and 15.5, 18.7 and 31.4 eager).

A KeysManager zygote's compiled successor compiles before it forks (`compile_here`), so its forks
serve compiled steps from their first (keysmanager/manager.py); a replica started otherwise
(forked before the successor took over, included) compiles on a thread of its own while eager
steps serve, at a low priority, once the replica idles (`engine/compile_policy.py`) and only
between its serving turns (`models/serving_first.py`), from inductor's caches, which a process
of its own filled first (`models/compile_worker.py`). Graphs are per thread count: a replica compiles for
each count its steps run on (its own, the host's idle cores), and the same way for a count CPU
compensation gives it later; steps on a count not compiled yet run eager. Only on the CPU (a
GPU's counterpart would be CUDA graphs: not built).

Prefills, and batches that mix them with decodes, stay eager: their lengths vary too much to
bucket, and a prompt runs once where its tokens run every step."""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch._inductor.config  # noqa: F401 - set before compiling (_configure)

from models.batched_decoder import BatchedDecoder, Step
from models.decode_batches import WARM_BATCHES, padded
from models.decoder_attention import PagedCall
from models.kv_cache import KVStore
from models.serving_first import SERVING_FIRST

log = logging.getLogger("quart.compiled_decode")

# Keys are read up to the batch's longest length rounded up to this: a step attends over a few
# padded positions at most, and the compiled function sees a handful of lengths per 1,000.
LENGTH_BUCKET = 64
INDUCTOR = {"cpp_wrapper": True}
# How often a compile waiting to start asks whether it may.
START_POLL_S = 0.25
# Held while any decode step of this process compiles; a compiled step that finds it free runs
# with only the guards that tell this process's graphs apart (`CompiledDecode.forward`).
_COMPILING = threading.Lock()


class CompiledDecode:
    def __init__(self, engine: BatchedDecoder) -> None:
        self.engine = engine
        self._dtype = engine.dtype
        # Every window a layer may pass its attention: the layer's own, else its config's.
        self._windows = sorted({w or 0 for layer in engine.layers
                                for w in (getattr(layer.self_attn, "sliding_window", None),
                                          getattr(layer.self_attn.config, "sliding_window", None))} | {0})
        self._fn = torch.compile(self._step, fullgraph=True, dynamic=True)
        # The thread counts compiled for: inductor sizes its kernels' parallel regions by the
        # count it compiles at, and dynamo guards on it, so a step on another count would compile
        # again, inline, in the serving thread (tens of seconds; the idle-cores collapse at 4
        # concurrent requests, docs/benchmarks.md). Such a step runs eager instead (`serves`).
        self._threads: frozenset[int] = frozenset()
        self.compile_s: float | None = None

    @property
    def ready(self) -> bool:
        return bool(self._threads)

    def covers(self, threads: int) -> bool:
        """Whether steps on `threads` threads have their graphs."""
        return threads in self._threads

    def serves(self, steps: list[Step]) -> bool:
        """Whether these steps run compiled: all decodes, in the dtype and on a thread count
        compiled for."""
        return (self.covers(torch.get_num_threads()) and self.engine.dtype == self._dtype and bool(self.engine.layers)
                and all(s.tokens == 1 and s.start > 0 for s in steps))

    def warm(self, threads: Sequence[int] = ()) -> float:
        """Compiles the graphs (one sequence; each bucket; more) for each thread count of
        `threads` (the calling thread's count where empty) on a scratch cache; seconds taken."""
        t0, own = time.perf_counter(), torch.get_num_threads()
        shape = self.engine.kv_shape()
        store = KVStore(shape, WARM_BATCHES[-1] * 2 * LENGTH_BUCKET * shape.bytes_per_token)
        with _COMPILING:
            for count in threads or (own,):
                # Every instance's graphs, one a batch size warmed for each count, are cached under
                # the one code object of `_step`, which torch limits to 8 (a process may build
                # several engines).
                torch._dynamo.config.recompile_limit += len(WARM_BATCHES)
                torch.set_num_threads(count)
                try:
                    for batch in WARM_BATCHES:
                        seqs = [store.admit(f"warm{count}.{i}", 2 * LENGTH_BUCKET) for i in range(batch)]
                        for start in (1, LENGTH_BUCKET + 1):  # two lengths: the length dimension goes dynamic
                            self._run([Step(seq, self._dummy(), start) for seq in seqs], store)
                        for seq in seqs:
                            store.free(seq.seq_id)
                finally:
                    torch.set_num_threads(own)
                self._threads |= {count}
        self.compile_s = (self.compile_s or 0.0) + time.perf_counter() - t0
        log.info("decode steps compiled for %s threads in %.1f s", "/".join(map(str, sorted(self._threads))),
                 self.compile_s)
        return self.compile_s

    def warm_in_background(self, nice: int = 0, may_start: Callable[[], bool] = lambda: True,
                           prepare: Callable[[], object] = lambda: None,
                           threads: Sequence[int] = ()) -> threading.Thread:
        """Compiles for each count of `threads` (the calling thread's where empty) on a thread of
        its own at `nice`, which the processes it starts inherit, once `may_start()` says so
        (asked every START_POLL_S), after `prepare()` (a compile in another process that fills
        inductor's caches: `models/compile_worker.py`; where it fails, this thread does the whole
        compile); eager steps serve until it is done, and the thread parks while they do
        (`models/serving_first.py`). A failure to compile leaves eager serving, and says why in
        the log."""
        # OpenMP keeps a thread count per thread (a new one sees the host's cores): the compiling
        # thread takes the counts asked for, this one's by default.
        threads = tuple(threads) or (torch.get_num_threads(),)

        def run() -> None:
            try:
                while not may_start():
                    time.sleep(START_POLL_S)
                lower_this_thread(nice)
                try:
                    prepare()  # waits on another process: Python's lock stays free for serving
                except Exception:  # noqa: BLE001 - the caches it fills only save this thread work
                    log.exception("preparing the compile failed; this replica compiles the whole step")
                SERVING_FIRST.yield_to_serving()
                try:
                    self.warm(threads)
                finally:
                    SERVING_FIRST.stop_yielding()
            except Exception:  # noqa: BLE001 - any compiler failure must leave eager serving
                log.exception("compiling the decode step failed; steps stay eager")
        thread = threading.Thread(target=run, name="compile-decode", daemon=True)
        thread.start()
        return thread

    def forward(self, steps: list[Step]) -> list[torch.Tensor]:
        """BatchedDecoder.forward's result for decode-only steps of one store."""
        store = steps[0].seq.store
        # Dynamo checks ~4,000 guards a call (a SmolLM2 stage of 11 layers: 1.0-1.3 ms of a
        # 7-17 ms step on one thread, measured). Once compiled, the batch size and key length are
        # all that varies, and torch's skip_guard_eval_unsafe runs only the guards that have told
        # this code's graphs apart (every one that has failed), engines of this process included.
        # It is global, so not while a compile runs: a graph being traced would go unguarded.
        # What no graph fits yet torch refuses under that stance before the step runs: it runs
        # again with every guard, compiling (`serves` keeps other thread counts from here).
        if _COMPILING.acquire(blocking=False):
            try:
                with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                    return self._run(steps, store)
            except RuntimeError as exc:
                if "skip_guard_eval_unsafe" not in str(exc):
                    raise
            finally:
                _COMPILING.release()
        return self._run(steps, store)

    @torch.inference_mode()
    def _run(self, steps: list[Step], store: KVStore) -> list[torch.Tensor]:
        _configure()
        device = self.engine.kv_shape().device
        given = len(steps)
        steps = padded(steps)
        inputs = torch.cat([s.inputs for s in steps])
        inputs = inputs.long() if self.engine.embed is not None else inputs.to(self.engine.dtype)
        positions = torch.tensor([s.start for s in steps])
        length = -(-(int(positions.max()) + 1) // LENGTH_BUCKET) * LENGTH_BUCKET
        read = torch.stack([_padded(s.seq.slots, length) for s in steps])
        span = torch.arange(length).unsqueeze(0)
        seen = span <= positions.unsqueeze(1)
        masks = {w or None: (seen & (span > positions.unsqueeze(1) - w) if w else seen).view(len(steps), 1, 1, length)
                 for w in self._windows}
        write = torch.stack([s.seq.slots[s.start] for s in steps])
        out = self._fn(inputs.to(device), positions.unsqueeze(1).to(device), write, read.to(device),
                       {k: m.to(device) for k, m in masks.items()}, store.keys, store.values)
        for s in steps:
            s.seq.length = s.start + 1
        # As the eager step returns them: logits [vocab], hidden states [1, width].
        return list(out[:given, 0]) if self.engine.head is not None else list(out[:given])

    def _step(self, inputs: torch.Tensor, positions: torch.Tensor, write: torch.Tensor, read: torch.Tensor,
              masks: dict[int | None, torch.Tensor], keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
        e = self.engine
        x = e.embed(inputs.unsqueeze(1)) if e.embed is not None else inputs.unsqueeze(1)
        x = e.layers_forward(x, positions, lambda i: PagedCall(i, write, read, masks, keys, values))
        return e.logits(x) if e.head is not None else x

    def _dummy(self) -> torch.Tensor:
        e = self.engine
        if e.embed is not None:
            return torch.zeros(1, dtype=torch.long)
        return torch.zeros(1, e.width, dtype=e.dtype)


def cannot_compile() -> str | None:
    """Why this host cannot compile a step (inductor's C++ kernels need a compiler: `g++`, or the
    one CXX names), or None."""
    from torch._inductor.cpp_builder import get_cpp_compiler
    try:
        get_cpp_compiler()
    except Exception as exc:  # noqa: BLE001 - inductor raises its own kinds; any means no compile
        return f"no C++ compiler for inductor ({exc})"
    return None


def _compiler_found() -> bool:
    if (why := cannot_compile()) is not None:
        log.warning("%s: decode steps stay eager", why)
        return False
    return True


def compile_in_background(engine: BatchedDecoder, nice: int = 0, may_start: Callable[[], bool] = lambda: True,
                          prepare: Callable[[], object] = lambda: None, threads: Sequence[int] = ()) -> None:
    """Compiles `engine`'s decode step (attached first where it has none) for `threads` on a
    thread of its own at `nice` once `may_start()` says so, after `prepare()` (eager steps serve
    meanwhile); nothing where this host has no compiler."""
    if _compiler_found():
        engine.compiled = engine.compiled or CompiledDecode(engine)
        engine.compiled.warm_in_background(nice, may_start, prepare, threads)


def compile_here(engine: BatchedDecoder, threads: Sequence[int] = ()) -> CompiledDecode | None:
    """Compiles `engine`'s decode step for `threads` in this thread and attaches it; None, and the
    reason in the log, where the compiler fails. For a process that forks afterwards (a
    KeysManager zygote): inductor's pool of compile workers is not started, so no thread of it
    outlives the compile."""
    if not _compiler_found():
        return None
    torch._inductor.config.compile_threads = 1
    compiled = CompiledDecode(engine)
    try:
        compiled.warm(threads)
    except Exception:  # noqa: BLE001 - any compiler failure must leave eager serving
        log.exception("compiling the decode step failed; steps stay eager")
        return None
    engine.compiled = compiled
    return compiled


def lower_this_thread(nice: int) -> None:
    """Names the calling thread `quart-compile` where the OS shows threads (top -H, /proc) and
    raises its nice value to `nice`, never lowering it. Linux keeps a nice value per thread, and a
    process started from the thread (inductor's compile workers, the C++ compiler) inherits it: on
    a host whose cores serve, a compile then runs on what serving leaves."""
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):  # only a name: a host without /proc shows none
        Path(f"/proc/self/task/{tid}/comm").write_text("quart-compile")
    try:
        os.setpriority(os.PRIO_PROCESS, tid, max(nice, os.getpriority(os.PRIO_PROCESS, tid)))
    except OSError as exc:  # a sandbox that refuses: the compile runs as it is
        log.warning("the compile thread keeps serving's priority (%s)", exc)


def _configure() -> None:
    """Inductor's settings for the compile, in the calling thread: they are per thread (a thread
    other than the one that set them sees the defaults)."""
    for key, value in INDUCTOR.items():
        if getattr(torch._inductor.config, key) != value:
            setattr(torch._inductor.config, key, value)


def _padded(slots: torch.Tensor, length: int) -> torch.Tensor:
    """A sequence's first `length` slots; past its capacity, its first slot again (masked out)."""
    if slots.shape[0] >= length:
        return slots[:length]
    return torch.cat([slots, slots[:1].expand(length - slots.shape[0])])

