"""Which results in benchmarks/results are older than the code they measure.

    python -m benchmarks freshness

A result is stale when the code its benchmark declares (`MEASURES` in the benchmark's module, and
the module itself) differs at HEAD from the commit it measured; the commits that changed it are
listed. Commits that touched that code and were undone later (a change tried and reverted) leave
the result fresh. Each result records the commit it measured (`conditions.commit`, `-dirty` when
the tree had changes); one written before results were stamped is taken to have measured the last
commit before its date, and says so. A comparison (side_by_side: its commit against the base it
names) measured the effect of the change between the two, which later commits do not alter: it is
listed as a comparison, never stale."""
from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from benchmarks.report import RESULTS, git, table
from contracts.paths import REPO_ROOT

NOT_BENCHMARKS = {"__init__", "__main__", "report", "freshness", "vllm_cpu"}


@dataclass(frozen=True)
class Freshness:
    result: str
    when: str
    commit: str | None          # the commit measured; None where git does not know it
    how: str                    # "stamped", "stamped, dirty tree", "from its date", "unknown commit"
    since: tuple[str, ...]      # commits after it that touch its code, newest first ("sha subject")
    base: str | None = None     # a comparison's other arm: the change measured is base..commit

    @property
    def stale(self) -> bool:
        return bool(self.since) or self.commit is None


def measured_commit(conditions: dict, repo: Path) -> tuple[str | None, str]:
    """The commit a result measured and how that is known."""
    stamped = conditions.get("commit")
    if stamped and stamped != "unknown":
        sha = stamped.removesuffix("-dirty")
        known = git(repo, "rev-parse", "--verify", "--quiet", f"{sha}^{{commit}}")
        if not known:
            return None, "unknown commit"
        return known, "stamped, dirty tree" if stamped.endswith("-dirty") else "stamped"
    when = conditions.get("when")
    before = git(repo, "rev-list", "-1", f"--before={when}", "HEAD") if when else ""
    return (before or None), ("from its date" if before else "unknown commit")


def touching(repo: Path, since: str, paths: tuple[str, ...]) -> tuple[str, ...]:
    """Commits after `since` up to HEAD that change any of `paths`, newest first; none where the
    paths are the same at both ends."""
    if not git(repo, "diff", "--name-only", since, "HEAD", "--", *paths):
        return ()
    out = git(repo, "log", "--format=%h %s", f"{since}..HEAD", "--", *paths)
    return tuple(line[:100] for line in out.splitlines())


def benchmark_of(stem: str, names: set[str]) -> str | None:
    """The benchmark that writes result `stem`: its name, or the longest name that prefixes it
    (generation writes generation_llama1b)."""
    candidates = [n for n in names if stem == n or stem.startswith(n + "_")]
    return max(candidates, key=len, default=None)


def declared_paths(benchmark: str) -> tuple[str, ...]:
    module = importlib.import_module(f"benchmarks.{benchmark}")
    return (*module.MEASURES, f"benchmarks/{benchmark}.py")


def freshness(results: Path = RESULTS, repo: Path = REPO_ROOT,
              paths_of=declared_paths) -> list[Freshness]:
    names = {p.stem for p in (repo / "benchmarks").glob("*.py")} - NOT_BENCHMARKS
    out = []
    for path in sorted(results.glob("*.json")):
        record = json.loads(path.read_text())
        benchmark = benchmark_of(path.stem, names)
        if not isinstance(record, dict) or "conditions" not in record or benchmark is None:
            continue  # a benchmark's side file (its runs), not a result
        conditions = record["conditions"]
        commit, how = measured_commit(conditions, repo)
        base = conditions.get("base")
        since = touching(repo, commit, paths_of(benchmark)) if commit and not base else ()
        out.append(Freshness(path.stem, conditions.get("when", "?"), commit, how, since, base))
    return out


def stale(found: list[Freshness], runnable: Collection[str]) -> list[str]:
    """The stale results that a benchmark of that name writes (`python -m benchmarks stale` runs
    them); results written by a benchmark's options (a CUDA run) are left to be run by hand."""
    return [f.result for f in found if f.stale and f.result in runnable]


def main(argv: list[str]) -> int:
    if argv:
        print(__doc__, file=sys.stderr)
        return 2
    if not git(REPO_ROOT, "rev-parse", "HEAD"):
        print("not a git checkout: freshness compares results with the commits that changed their code",
              file=sys.stderr)
        return 2
    rows = []
    for f in freshness():
        status = (f"stale: {len(f.since)} commit(s) since, latest {f.since[0].split()[0]}" if f.since
                  else "stale: its commit is unknown here" if f.commit is None
                  else f"a comparison against {f.base[:9]}" if f.base else "fresh")
        rows.append([f.result, (f.commit or "-")[:9], f.how, f.when, status])
    print(table("results and the code they measured", ["result", "commit", "how known", "measured", "status"], rows))
    return 0
