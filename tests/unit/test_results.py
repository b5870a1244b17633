"""Benchmark results a reader can date: every benchmark declares the code it measures, freshness
finds the results a later commit made stale (in a real git repository), docs/results.md is what
the JSON holds, and the 95 % intervals use Student's t for any number of runs."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from benchmarks import __main__ as bench
from benchmarks.freshness import benchmark_of, declared_paths, freshness, stale
from benchmarks.report import CPU_FEATURES, commit, conditions, mean_ci95, read_bandwidth, scratch, t975, verdict
from contracts.paths import REPO_ROOT
from tools.results_page import results_page


def test_every_benchmark_declares_code_that_exists():
    modules = {p.stem for p in (REPO_ROOT / "benchmarks").glob("*.py")}
    for name in {benchmark_of(b, modules) for b in bench.BENCHMARKS}:
        paths = declared_paths(name)
        assert paths, name
        for path in paths:
            if not path.startswith(":("):  # a git pathspec's exclusion
                assert (REPO_ROOT / path).exists(), f"{name} declares {path}, which is not in the repository"


def test_a_result_belongs_to_its_longest_named_benchmark():
    names = {"generation", "simulator", "simulator_policies"}
    assert benchmark_of("generation_llama1b", names) == "generation"
    assert benchmark_of("simulator_policies", names) == "simulator_policies"
    assert benchmark_of("simulator_policies_runs", names) == "simulator_policies"
    assert benchmark_of("generational", names) is None


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


def _commit(repo: Path, path: str, text: str) -> str:
    (repo / path).parent.mkdir(parents=True, exist_ok=True)
    (repo / path).write_text(text)
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", f"change {path}")
    return _git(repo, "rev-parse", "HEAD")


def test_a_result_goes_stale_only_when_its_code_changes(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "fast.py").write_text("")
    measured = _commit(tmp_path, "engine/step.py", "v1")
    results = tmp_path / "results"
    results.mkdir()
    for name, stamp in (("fast", measured), ("fast_other", measured + "-dirty")):
        (results / f"{name}.json").write_text(json.dumps({"conditions": {"commit": stamp, "when": "x"}, "figures": []}))
    (results / "fast_runs.json").write_text("[]")  # a side file, not a result
    paths = {"fast": ("engine",)}.__getitem__

    def check():
        return {f.result: (f.how, len(f.since)) for f in freshness(results, tmp_path, paths)}

    assert check() == {"fast": ("stamped", 0), "fast_other": ("stamped, dirty tree", 0)}
    _commit(tmp_path, "docs/readme.md", "unrelated")
    assert check() == {"fast": ("stamped", 0), "fast_other": ("stamped, dirty tree", 0)}
    _commit(tmp_path, "engine/step.py", "v2")
    assert check() == {"fast": ("stamped", 1), "fast_other": ("stamped, dirty tree", 1)}
    _commit(tmp_path, "engine/step.py", "v1")  # tried and reverted: the code measured is HEAD's again
    assert check() == {"fast": ("stamped", 0), "fast_other": ("stamped, dirty tree", 0)}
    _commit(tmp_path, "engine/step.py", "v2")
    assert check() == {"fast": ("stamped", 3), "fast_other": ("stamped, dirty tree", 3)}
    assert stale(freshness(results, tmp_path, paths), {"fast", "slow"}) == ["fast"]  # fast_other: no such benchmark
    # A side-by-side comparison measured the change base..commit, which later commits do not alter.
    (results / "fast_compared.json").write_text(
        json.dumps({"conditions": {"commit": measured, "base": measured, "when": "x"}, "figures": []}))
    [compared] = [f for f in freshness(results, tmp_path, paths) if f.result == "fast_compared"]
    assert compared.base == measured and not compared.since and not compared.stale
    (results / "fast.json").write_text(json.dumps({"conditions": {"commit": "0" * 40}, "figures": []}))
    [unknown] = [f for f in freshness(results, tmp_path, paths) if f.result == "fast"]
    assert unknown.how == "unknown commit" and unknown.stale


def test_a_result_is_stamped_dirty_only_for_changes_to_code(tmp_path):
    _git(tmp_path, "init", "-q")
    _commit(tmp_path, "engine/step.py", "v1")
    _commit(tmp_path, "README.md", "read me")
    head = _git(tmp_path, "rev-parse", "HEAD")
    (tmp_path / "README.md").write_text("edited while measuring")
    (tmp_path / "docs").mkdir()
    assert commit(tmp_path) == head
    (tmp_path / "engine" / "step.py").write_text("v2")
    assert commit(tmp_path) == head + "-dirty"


def test_the_results_page_is_what_the_json_holds():
    page = (REPO_ROOT / "docs" / "results.md").read_text()
    assert page == results_page(), "docs/results.md is out of date: run `make docs`"


@pytest.mark.parametrize(("df", "t"), [(1, 12.706), (2, 4.303), (4, 2.776), (10, 2.228), (11, 2.201),
                                       (20, 2.086), (30, 2.042), (120, 1.980)])
def test_students_t_for_any_number_of_runs(df, t):
    assert t975(df) == pytest.approx(t, abs=1e-3)


def test_an_interval_from_runs():
    mean, half = mean_ci95([1.0, 2.0, 3.0])
    assert mean == 2.0 and half == pytest.approx(4.303 * 1.0 / 3 ** 0.5, rel=1e-3)
    assert mean_ci95([5.0]) == (5.0, 0.0)


def test_results_say_which_cpu_and_features_measured_them():
    threads = torch.get_num_threads()
    stamped = conditions(extra=1)
    assert stamped["host_read_gb_s"] > 0 and torch.get_num_threads() == threads
    assert stamped["cpu_model"] and set(stamped["cpu_features"]) <= set(CPU_FEATURES) and stamped["extra"] == 1
    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
    assert ("avx2" in stamped["cpu_features"]) == ("avx2" in flags)


def test_the_bandwidth_probe_leaves_the_callers_thread_count_as_it_was():
    before = torch.get_num_threads()
    assert read_bandwidth(2 if before == 1 else 1, nbytes=1 << 20) > 0
    assert torch.get_num_threads() == before


def test_a_target_is_met_only_when_the_whole_interval_clears_it():
    assert verdict(1.0, 0.1, 1.2) == "met" and verdict(1.3, 0.05, 1.2) == "missed"
    assert verdict(1.15, 0.1, 1.2) == "not separable from the target"
    assert verdict(1.8, 0.2, 1.5, at_least=True) == "met" and verdict(1.2, 0.2, 1.5, at_least=True) == "missed"
    assert verdict(1.55, 0.1, 1.5, at_least=True) == "not separable from the target"


def test_a_run_keeps_its_files_only_when_it_fails(capsys):
    with scratch("quart-test-") as kept_for:
        (kept_for / "logs").mkdir()
    assert not kept_for.exists()
    with pytest.raises(RuntimeError), scratch("quart-test-") as failed:
        (failed / "logs").mkdir()
        raise RuntimeError("a replica died")
    assert (failed / "logs").is_dir()
    assert str(failed) in capsys.readouterr().err
    shutil.rmtree(failed)
