"""What every benchmark shares: percentiles, a printed table, the JSON result file, and a scratch
directory for a run."""
from __future__ import annotations

import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from contracts.config import load_settings
from contracts.paths import BENCHMARK_RESULTS as RESULTS
from contracts.paths import REPO_ROOT
from models.precision import cpu_field, cpu_flags

# The serving system's code: what a benchmark running the embedded runtime measures (MEASURES);
# not runtime/ports.py, which picks the ports tests and benchmarks start runtimes on (no figure depends on one).
SERVING = ("autoscaler", "contracts", "engine", "frontend", "functions", "keysmanager", "models", "runtime",
           "scheduler", "state", "stack.yml", ":(exclude)runtime/ports.py")
# The stage-level simulator: sim/ without the model-level one (git pathspecs).
SIMULATOR = ("sim", ":(exclude)sim/serverless.py", ":(exclude)sim/scaleout.py")


@contextmanager
def scratch(prefix: str) -> Iterator[Path]:
    """A directory for one run (a runtime's home, its logs included): removed when the run ends
    well, kept and named when it fails, so that its logs can say why."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield path
    except BaseException:
        print(f"the run failed; its files, logs included, are kept in {path}", file=sys.stderr, flush=True)
        raise
    shutil.rmtree(path, ignore_errors=True)


def percentiles(samples_ms: list[float]) -> dict[str, float]:
    a = np.asarray(samples_ms, dtype=float)
    return {"p50": round(float(np.percentile(a, 50)), 3), "p99": round(float(np.percentile(a, 99)), 3),
            "mean": round(float(a.mean()), 3), "n": int(a.size)}


def t975(df: int) -> float:
    """Student's t at 97.5 % with `df` degrees of freedom (a 95 % interval's multiplier), for any
    df: the density integrated numerically and the quantile found by bisection (scipy is not a
    dependency for this one number)."""
    if df < 1:
        raise ValueError("a t quantile needs at least one degree of freedom")
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def upper_tail(x: float) -> float:
        # P(T > x) = 0.5 - integral_0^x pdf; substitute t = tan(u) so df = 1's heavy tail stays finite
        u = np.linspace(0.0, math.atan(x), 20001)
        t = np.tan(u)
        pdf = np.exp(log_norm - (df + 1) / 2 * np.log1p(t * t / df)) * (1 + t * t)
        return 0.5 - float(np.sum((pdf[1:] + pdf[:-1]) / 2 * np.diff(u)))

    lo, hi = 0.0, 100.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if upper_tail(mid) > 0.025 else (lo, mid)
    return (lo + hi) / 2


def mean_ci95(values: list[float]) -> tuple[float, float]:
    """The mean and the half-width of its 95 % interval (Student's t; 0 for one value)."""
    a = np.asarray(values, dtype=float)
    if len(a) < 2:
        return float(a.mean()), 0.0
    return float(a.mean()), float(t975(len(a) - 1) * a.std(ddof=1) / np.sqrt(len(a)))


def verdict(mean: float, half: float, target: float, at_least: bool = False) -> str:
    """Whether a figure met its target (an upper bound; a lower one `at_least`): only when its
    whole 95 % interval clears the target, missed only when the whole interval is past it."""
    low, high = mean - half, mean + half
    if (low >= target) if at_least else (high <= target):
        return "met"
    return "missed" if ((high < target) if at_least else (low > target)) else "not separable from the target"


# What a benchmark does not run: edits to these while it measures leave its commit clean.
NOT_MEASURED = (":(exclude)*.md", ":(exclude)docs", ":(exclude)benchmarks/results")


def git(repo: Path, *args: str) -> str:
    """What `git args` prints in `repo`; empty where it fails (not a checkout, an unknown commit)."""
    done = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else ""


def commit(repo: Path = REPO_ROOT) -> str:
    """The commit measured, `-dirty` when the working tree's code differs from it; a copy of the
    tree without its .git names its commit in QUART_SOURCE_COMMIT."""
    head = git(repo, "rev-parse", "HEAD") or load_settings().source_commit or "unknown"
    changed = git(repo, "status", "--porcelain", "--untracked-files=no", "--", ".", *NOT_MEASURED)
    return head + ("-dirty" if changed else "")


# The CPU features that decide a figure here: bfloat16 in hardware (the dtype `auto` serves), oneDNN's paths.
CPU_FEATURES = ("avx2", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16", "amx_tile")


def host_read_gb_s() -> float:
    """This host's memory read bandwidth on all its cores now, in GB/s: how fast the machine was
    when a result was written. Hosts sold as one kind differ (a 2-core EPYC VM read 29-31 GB/s one
    day and 16-26 the next, and ran the same Redis hops 1.4-2.9x slower), so absolute figures are
    compared only where this one is close."""
    return round(read_bandwidth(len(os.sched_getaffinity(0))) / 1e9, 1)


def conditions(**extra: object) -> dict:
    return {"machine": platform.node(), "host_read_gb_s": host_read_gb_s(), "commit": commit(),
            "cpu": platform.processor() or platform.machine(),
            "cpu_model": cpu_field("model name") or platform.machine(),
            "cpu_features": [f for f in CPU_FEATURES if f in cpu_flags()],
            "cores": len(os.sched_getaffinity(0)), "torch": torch.__version__,
            "cuda": torch.cuda.is_available(), "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            # Replicas of real generative models compile their decode steps unless QUART_COMPILE is off.
            "compiled_decode_steps": load_settings().compute.compiles, **extra}


def read_bandwidth(threads: int, device: str = "cpu", nbytes: int = 1 << 30) -> float:
    """The memory read bandwidth of `device` in bytes/s: the best of ten sums over a buffer far
    larger than its caches (4 GiB on a GPU, where 1 GiB takes a fraction of a millisecond), on
    `threads` threads; the caller's thread count is left as it was."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    gpu = device.startswith("cuda")
    nbytes = 4 << 30 if gpu else nbytes
    try:
        buffer = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        best = float("inf")
        for _ in range(10):
            t0 = time.perf_counter()
            buffer.sum()
            if gpu:
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - t0)
        return nbytes / best
    finally:
        torch.set_num_threads(before)


def table(title: str, header: list[str], rows: list[list[object]]) -> str:
    cells = [header] + [[f"{c:.3f}" if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [title, "  ".join(h.ljust(w) for h, w in zip(header, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells[1:]]
    return "\n".join(lines)


def write(name: str, figures: list[dict], conds: dict) -> Path:
    """figures: [{"name", "value", "unit", ...}] — every figure with its unit."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"benchmark": name, "conditions": conds, "figures": figures}, indent=1))
    return path
