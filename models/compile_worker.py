"""Compiles a stage's decode step in a process of its own, so that a replica compiling beside its
serving finds inductor's on-disk caches full and compiles from them.

A replica not forked from a compiled zygote compiles on a thread, which must park while serving
turns run (`models/serving_first.py`): Python's lock is the process's, and OS priorities cannot
share it. The hook that parks it slowed the compile severalfold, and under steady load it ran only
in the gaps (not done within 600 s, against about 100 s alone; measured 2026-12-04). Here the
work that takes most of those seconds (lowering, code generation, the C++ compiler) runs in a
process of its own, at the compile's low priority, which the OS scheduler does honour across
processes; the replica then traces its step and loads the kernels from the cache, a fraction of
the work, parked as before. The compiled code does not depend on the weights' values (inductor's
freezing is off), only on the code, the shapes, the dtypes and the layout, which this process
builds the same way from the same shards.

The cost: a second copy of the stage's weights in memory while this process runs, read from the
server's disk (a shard only in the prefetcher's memory is not there: the replica then compiles
in-process, as before).

    python -m models.compile_worker MANIFEST_DIR FIRST LAST --dtype D --threads N [--no-prepack]
"""
from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time

from contracts.paths import REPO_ROOT

log = logging.getLogger("quart.compile_worker")

# How long a replica waits for the worker before compiling in-process all the same.
TIMEOUT_S = 1800.0


def fill_cache(manifest_dir: str, first: int, last: int, dtype: str, threads: int, prepack: bool) -> bool:
    """Runs the worker for stages [first, last) and waits for it; whether it compiled. Called
    from the compile's thread: the worker inherits that thread's nice value."""
    argv = [sys.executable, "-m", "models.compile_worker", manifest_dir, str(first), str(last), "--dtype", dtype,
            "--threads", str(threads), *([] if prepack else ["--no-prepack"])]
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
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--no-prepack", dest="prepack", action="store_false")
    args = parser.parse_args(argv)
    logging.basicConfig(level=os.environ.get("QUART_LOG_LEVEL", "INFO"), stream=sys.stderr)
    import torch

    from models.compiled_decode import compile_here
    from models.manifest import Manifest
    from models.stage_runner import StageRunner

    torch.set_num_threads(args.threads)  # inductor sizes its kernels' parallel regions by it
    runner = StageRunner(Manifest.load(args.manifest), args.first, args.last, "cpu", args.dtype,
                         prepack=args.prepack)  # int8 weights do not compile (Compute.compiles)
    return 0 if compile_here(runner.batched()) is not None else 1


if __name__ == "__main__":
    sys.exit(main())
