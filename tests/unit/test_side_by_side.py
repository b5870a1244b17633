"""benchmarks/side_by_side.py: an arm runs the tree it is given (not this one), and the report
says a gain only where every round's interval is past 1."""
from __future__ import annotations

import json

import pytest

from benchmarks import report as bench_report
from benchmarks import side_by_side

# A stand-in tree: the serving harness the arm imports, answering what its tree is.
FAKE_TREE = {
    "benchmarks/__init__.py": "",
    "benchmarks/report.py": "SERVING = ()\n",
    "benchmarks/generation.py": """
from contextlib import contextmanager
from types import SimpleNamespace

@contextmanager
def running(model, new, **changes):
    assert changes == {"compile": False}, changes
    yield SimpleNamespace(gateway=SimpleNamespace(url="unused"))

def pipeline_request(client, model, text, new):
    return {"tpot_ms": 42.0, "ttft_ms": 120.0, "token_ids": [1] * new}
""",
    "contracts/__init__.py": "",
    "contracts/http_client.py": "class GatewayClient:\n    def __init__(self, url, timeout):\n        pass\n",
    "loadgen/__init__.py": "",
    "loadgen/sharegpt.py": "def first_prompts(n, seed, max_chars):\n    return ['a prompt'] * n\n",
}


def test_an_arm_measures_the_tree_it_runs_in(tmp_path, capsys):
    for name, text in FAKE_TREE.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    figures = side_by_side._run_arm(tmp_path, str(tmp_path / "models"), {"compile": False}, "an arm")
    assert figures["tpot_ms"] == 42.0 and figures["ttft_ms"] == 120.0
    assert set(figures) == set(side_by_side.FIGURES)


def test_an_arm_that_fails_stops_the_comparison(tmp_path):
    with pytest.raises(SystemExit, match="failed"):
        side_by_side._run_arm(tmp_path, str(tmp_path), {}, "a tree without the harness")


def _rounds(tpots: list[tuple[float, float]]) -> list[dict]:
    return [{"base": {"tpot_ms": b, "tps_4": 10.0, "tps_16": 20.0},
             "new": {"tpot_ms": n, "tps_4": 10.0 * (1 + 0.01 * i), "tps_16": 20.0}}
            for i, (b, n) in enumerate(tpots)]


def test_the_report_calls_a_gain_only_past_the_interval(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_report, "RESULTS", tmp_path)
    out = side_by_side.report("cmp", _rounds([(100, 90), (110, 98), (105, 95)]), ("base", "new"), "a test")
    figures = {f["name"]: f for f in json.loads((tmp_path / "cmp.json").read_text())["figures"]}
    tpot = figures["TPOT, one request at a time, new/base"]
    assert tpot["verdict"] == "gain" and tpot["ci95"][1] < 1.0
    assert tpot["per_round"] == [0.9, 0.891, 0.905]
    assert figures["TPOT, one request at a time, base"]["value"] == 105.0  # the median over rounds
    # Throughput 1.00, 1.01, 1.02 over three rounds: its interval spans 1.
    assert figures["throughput, 4 concurrent, new/base"]["verdict"] == "no difference shown"
    assert figures["throughput, 16 concurrent, new/base"]["verdict"] == "no difference shown"
    assert (tmp_path / "cmp.png").is_file() and out["conditions"]["rounds"] == 3


def test_a_figure_that_the_base_commit_did_not_measure_is_left_out(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_report, "RESULTS", tmp_path)
    rounds = _rounds([(100, 90), (110, 98), (105, 95)])
    for r in rounds:
        r["new"]["ttft_ms"] = 300.0  # measured by this tree's arm only
    side_by_side.report("cmp", rounds, ("base", "new"), "a test")
    names = {f["name"] for f in json.loads((tmp_path / "cmp.json").read_text())["figures"]}
    assert "TPOT, one request at a time, new/base" in names and not any(n.startswith("TTFT") for n in names)
