"""Where this repository's own code lies, for the processes that start other processes from it."""
from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# Where every benchmark writes its result (JSON, plots), and docs/results.md is generated from.
BENCHMARK_RESULTS = REPO_ROOT / "benchmarks" / "results"
# The handler every stage function runs (a zygote's forked children run it too). In an image, the
# handler lies beside the packages (template/quart-python: /home/app/function).
STAGE_HANDLER = REPO_ROOT / "functions" / "stage" if (REPO_ROOT / "functions").is_dir() else REPO_ROOT
