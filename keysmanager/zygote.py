"""A zygote: one process that holds a stage range's parameters in host memory and forks stage
replicas from them. A *runtime* zygote holds no parameters, only the imported libraries: a replica
forked from it is a cold start without the process creation and imports (a pre-warmed runtime, as
serverless platforms keep), which then streams its shard in like any cold replica.

It loads its tensors in the dtype the replicas serve and packs their linear weights
(`models/packed_linear.py`), on one thread, so that no child converts or packs them again; it
never runs multi-threaded kernels and never initialises CUDA, because a process that has started
OpenMP's thread pool (or CUDA) can hang its forked children. A child sets its own threads and
device after the fork. Copy-on-write children share the parent's pages; a non-COW child clones
the parameters first, for isolation.

With `--compile` it compiles the stage's decode step too before it answers (without inductor's
worker pool, on a thread at QUART_COMPILE_NICE that has ended before the first fork): every child
inherits the compiled step. The KeysManager starts such a zygote as the *successor* of one that
answered as soon as it had loaded, and swaps it in once it answers (keysmanager/manager.py), so
that a compile never keeps a stage from being cached and forked.

Control is a Unix socket (it listens once the zygote is ready) that takes one JSON line per
connection:
    {"op": "fork", "cow": true, "env": {...}, "handler": "...", "port_file": "...", "log_file": "..."}
    {"op": "ping"}
and answers one JSON line ({"pid": ...} or {"ok": true, ...}, or {"error": ...}).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

# torch.cuda.is_available() (transformers asks it) would otherwise initialise the CUDA driver in
# this process to count devices, and a child forked after that cannot use CUDA; through NVML it
# counts them without that.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

# Everything a replica needs, imported before any fork so that a child starts warm.
import aiohttp  # noqa: E402, F401
import torch  # noqa: E402

from contracts.config import load_settings
from contracts.stage import StageRef
from engine import inherited, watchdog
from engine import replica as _replica  # noqa: F401
from models.compiled_decode import cannot_compile, compile_here, lower_this_thread
from models.emulated import EmulatedRunner
from models.manifest import Manifest
from models.profiles import profile as emulation_profile
from models.stage_runner import StageRunner


def _reap(*_: object) -> None:
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass


def _become_replica(runner: StageRunner | EmulatedRunner | None, request: dict, server: socket.socket,
                    conn: socket.socket) -> None:
    """Runs in the child: turns the inherited parameters into a serving stage replica."""
    server.close()
    conn.close()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGALRM, signal.SIG_DFL)   # the zygote's orphan check is not the replica's
    log = os.open(request["log_file"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.update(request.get("env") or {})
    settings = load_settings()
    if runner is None:
        os.environ["QUART_STARTED_BY"] = "cold"  # it loads its parameters itself
        print("forked from the runtime zygote: reading the shard", file=sys.stderr, flush=True)
    else:
        os.environ["QUART_STARTED_BY"] = "fork-cow" if request.get("cow", True) else "fork-copy"
        t0 = time.perf_counter()
        if isinstance(runner, StageRunner):
            if not request.get("cow", True):
                runner.clone_parameters()
            compute = settings.compute
            runner.to(compute.device, compute.dtype, compute.prepack, compute.quantize)
        else:
            runner.reseed()
        print(f"forked: parameters ready in {(time.perf_counter() - t0) * 1000:.1f} ms "
              f"({'shared' if request.get('cow', True) else 'cloned'})", file=sys.stderr, flush=True)
    inherited.RUNNER = runner
    watchdog.main(["--handler", request["handler"], "--port-file", request["port_file"]])


def _fork(runner: StageRunner | EmulatedRunner | None, request: dict, server: socket.socket, conn: socket.socket) -> int:
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            _become_replica(runner, request, server, conn)
        except BaseException:  # the child must never return into the zygote's loop
            traceback.print_exc()
            code = 1
        os._exit(code)
    return pid


def _exit_when_orphaned(period_s: float = 1.0) -> None:
    """A zygote whose KeysManager died (kill -9 included) exits: the KeysManager started again
    caches afresh, and nothing else would ever end it. Checked by a timer signal, not a thread
    (a thread at fork time could hold a lock the child then waits on forever)."""
    parent = os.getppid()

    def check(*_: object) -> None:
        if os.getppid() != parent:
            sys.exit(0)
    signal.signal(signal.SIGALRM, check)
    signal.setitimer(signal.ITIMER_REAL, period_s, period_s)


def _compile(runner: StageRunner, nice: int) -> bool:
    """The decode step compiled once here, before any fork, for one thread: every replica forked
    afterwards serves compiled steps from its first (models/compiled_decode.py). On a thread of its
    own at `nice` (Linux keeps it per thread, so the forks, from this one, keep serving's), which
    has ended when this returns. Whether it compiled."""
    done: list[object] = []

    def run() -> None:
        lower_this_thread(nice)
        done.append(compile_here(runner.batched()))
    thread = threading.Thread(target=run, name="zygote-compile")
    thread.start()
    thread.join()
    compiled = done[0] if done else None
    outcome = f"in {compiled.compile_s:.1f} s" if compiled else "failed"
    print(f"decode steps compiled {outcome}; threads now {threading.active_count()}", file=sys.stderr, flush=True)
    return compiled is not None


def serve(runner: StageRunner | EmulatedRunner | None, socket_path: Path) -> None:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    socket_path.unlink(missing_ok=True)
    server.bind(str(socket_path))
    server.listen(16)
    signal.signal(signal.SIGCHLD, _reap)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    _exit_when_orphaned()
    # Objects that exist now are never collected: the collector would otherwise touch (and so
    # copy) their pages in every child.
    gc.collect()
    gc.freeze()
    while True:
        try:
            conn, _ = server.accept()
        except InterruptedError:
            continue
        with conn:
            try:
                request = json.loads(conn.makefile("rb").readline())
                if request.get("op") == "fork":
                    answer = {"pid": _fork(runner, request, server, conn)}
                else:
                    answer = {"ok": True, "pid": os.getpid()}
            except (ValueError, KeyError, OSError) as exc:
                answer = {"error": str(exc)}
            try:
                conn.sendall(json.dumps(answer).encode() + b"\n")
            except OSError:
                pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model")
    parser.add_argument("--stages", help='"a" or "a-b" (b exclusive)')
    parser.add_argument("--socket", type=Path, required=True)
    parser.add_argument("--emulate", default="", help="an emulation profile: no shard to hold")
    parser.add_argument("--runtime", action="store_true", help="hold no parameters, only the libraries")
    parser.add_argument("--compile", action="store_true", help="compile the decode step before answering")
    args = parser.parse_args(argv)
    settings = load_settings()
    if args.runtime:
        serve(None, args.socket)
        return 0
    if not (args.model and args.stages):
        parser.error("--model and --stages, or --runtime")
    stage = StageRef.parse(args.model, args.stages)
    if args.emulate:
        runner = EmulatedRunner(emulation_profile(args.emulate), stage.model, stage.first, stage.last)
    else:
        # One thread: converting and packing the weights here (once, for every child) must not
        # start a pool of OpenMP threads, which a forked child could not use.
        torch.set_num_threads(1)
        runner = StageRunner(Manifest.load(settings.model_dir(stage.model)), stage.first, stage.last,
                             device="cpu", dtype=settings.compute.dtype, prepack=settings.compute.prepack,
                             quantize=settings.compute.quantize)
        if settings.compute.compiles and runner.manifest.generative:
            if args.compile:
                if not _compile(runner, settings.compute.compile_nice):
                    return 1  # the zygote it was to succeed serves on, uncompiled
            else:
                # A replica asks for inductor's C++ compiler as it starts (models/compiled_decode.py);
                # a compile asked already. Imported here once, not in every fork on its way to its
                # first work (a fork in the KeysManager's container: 220 ms without, 80 with it).
                cannot_compile()
    assert not torch.cuda.is_initialized()
    serve(runner, args.socket)
    return 0


if __name__ == "__main__":
    sys.exit(main())
