"""Compiles a stage's decode step in a process of its own, so that a replica compiling beside its
serving finds inductor's on-disk caches full and compiles from them.

A replica not forked from a compiled zygote compiles on a thread, which must park while serving
turns run (`models/serving_first.py`): Python's lock is the process's, and OS priorities cannot
share it. The hook that parks it slowed the compile severalfold (one SmolLM2 stage, empty cache,
quiet host: not done after 13 minutes, against 104 s without it; measured 2026-12-04), and under
load it runs only in the gaps between turns. Here the
work that takes most of those seconds (lowering, code generation, the C++ compiler) runs in a
process of its own, at the compile's low priority, which the OS scheduler does honour across
processes; the replica then traces its step and loads the kernels from the cache, a fraction of
the work, parked as before. The compiled code does not depend on the weights' values (inductor's
freezing is off), only on the code, the shapes, the dtypes and the layout, which this process
builds the same way from the same shards.

The cost: a second copy of the stage's weights in memory while this process runs, read from the
server's disk (a shard only in the prefetcher's memory is not there: the replica then compiles
in-process, as before). It dies with the replica (a replica removed mid-compile leaves no orphan
holding that copy).

    python -m models.compile_worker MANIFEST_DIR FIRST LAST --dtype D --threads N [N ...] [--no-prepack] [--parent PID]
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from contracts.paths import REPO_ROOT

log = logging.getLogger("quart.compile_worker")

# How long a replica waits for the worker before compiling in-process all the same.
TIMEOUT_S = 1800.0
PR_SET_PDEATHSIG = 1  # <sys/prctl.h>


def fill_cache(manifest_dir: str, first: int, last: int, dtype: str, threads: Sequence[int], prepack: bool) -> bool:
    """Runs the worker for stages [first, last) on each of `threads` and waits for it; whether it
    compiled. Called from the compile's thread: the worker inherits that thread's nice value."""
    argv = [sys.executable, "-m", "models.compile_worker", manifest_dir, str(first), str(last), "--dtype", dtype,
            "--threads", *map(str, threads), "--parent", str(os.getpid()), *([] if prepack else ["--no-prepack"])]
    started = time.monotonic()
    try:
        done = subprocess.run(argv, cwd=REPO_ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, timeout=TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        log.warning("the compile worker did not finish in %.0f s; compiling in this process", TIMEOUT_S)
        return False
    if done.returncode != 0:
        log.warning("the compile worker failed (exit %d); compiling in this process: %s", done.returncode,
                    done.stderr.decode(errors="replace")[-2000:])
        return False
    log.info("the compile worker filled inductor's caches in %.1f s", time.monotonic() - started)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m models.compile_worker", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("manifest", help="the model's directory (its manifest and shards)")
    parser.add_argument("first", type=int)
    parser.add_argument("last", type=int)
    parser.add_argument("--dtype", required=True)
    parser.add_argument("--threads", type=int, nargs="+", required=True,
                        help="the thread counts the replica's steps run on (inductor compiles for each)")
    parser.add_argument("--no-prepack", dest="prepack", action="store_false")
    parser.add_argument("--parent", type=int, help="die with this process (the replica)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=os.environ.get("QUART_LOG_LEVEL", "INFO"), stream=sys.stderr)
    if args.parent:
        _die_with_parent(args.parent)
    import torch

    from models.compiled_decode import compile_here
    from models.manifest import Manifest
    from models.stage_runner import StageRunner

    torch.set_num_threads(min(args.threads))  # converting the weights needs no more
    runner = StageRunner(Manifest.load(args.manifest), args.first, args.last, "cpu", args.dtype,
                         prepack=args.prepack)  # int8 weights do not compile (Compute.compiles)
    return 0 if compile_here(runner.batched(), args.threads) is not None else 1


def _die_with_parent(parent: int) -> None:
    """Linux's parent-death signal: killed when the thread that started this process ends (the
    replica's compile thread waits for it, so: when the replica is gone). Elsewhere, none."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the replica died before the signal was set
        sys.exit(1)


if __name__ == "__main__":
    sys.exit(main())
