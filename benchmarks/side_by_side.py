"""A change measured against its base, side by side: the 4-stage SmolLM2 pipeline served by two
commits of this repository alternately, in rounds (base then new in odd rounds, new then base in
even ones), so that a VM whose speed drifts within the hour weighs on both arms alike; each round
compares the two arms it ran back to back.

    python -m benchmarks side_by_side --base REV [--rounds 4] [--eager] [--dtype float32]

"new" is this working tree as it is (committed or not), "base" the commit REV, checked out in a
worktree of its own (removed afterwards) and run with this tree's virtual environment and
partitioned models. Per arm, one runtime (one replica per stage, compiled steps unless --eager):
the time per output token and to the first token of single requests (ShareGPT prompts, 96 new
tokens, end of text ignored, one at a time), then the tokens per second of 4 and 16 concurrent
requests (each client sends two of 32 tokens). Reported: each figure per arm, and per round the
ratio new/base, with the mean ratio's 95 % interval over the rounds; "gain" only where the whole
interval is on the better side of 1. With --dtype both arms serve that dtype (QUART_DTYPE), and the result is named
`side_by_side_<dtype>`. The base must have `benchmarks.generation.running` (the serving harness
this measures with) and read the partitions this tree wrote.

An arm runs this file as a script in the arm's tree, so every import but the standard library's
is that tree's."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__" and sys.argv[1:2] == ["--arm"]:
    # Run as a file in an arm's tree: this folder is no package root, and its modules' names
    # (loadgen.py) would hide the tree's packages.
    sys.path.pop(0)

from benchmarks.report import SERVING  # noqa: E402 - after the path is the arm's

MEASURES = SERVING + ("loadgen", "benchmarks/generation.py")  # the code measured (benchmarks/freshness.py)

MODEL, NEW, LOADED_NEW, SINGLE = "smollm2", 96, 32, 4
LEVELS = (4, 16)
ARMS = ("base", "new")
# Each figure: its label, unit, and whether higher is better.
FIGURES = {"tpot_ms": ("TPOT, one request at a time", "ms", False),
           "ttft_ms": ("TTFT, one request at a time", "ms", False),
           **{f"tps_{level}": (f"throughput, {level} concurrent", "tokens/s", True) for level in LEVELS}}
RESULT = "RESULT "  # the line an arm prints its figures on


def measure(texts: list[str], **changes: object) -> dict[str, float]:
    """FIGURES of one runtime started with settings `changes` (benchmarks.generation.running)."""
    from concurrent.futures import ThreadPoolExecutor

    from benchmarks.generation import pipeline_request, running
    from contracts.http_client import GatewayClient

    with running(MODEL, NEW, **changes) as settings:
        client = GatewayClient(settings.gateway.url, timeout=600)
        single = [pipeline_request(client, MODEL, text, NEW) for text in texts[:SINGLE]]
        out = {key: statistics.median(a[key] for a in single) for key in ("tpot_ms", "ttft_ms")}
        for level in LEVELS:
            t0 = time.perf_counter()
            with ThreadPoolExecutor(level) as pool:
                answers = list(pool.map(lambda t: [pipeline_request(client, MODEL, t, LOADED_NEW) for _ in range(2)],
                                        texts[SINGLE:SINGLE + level]))
            tokens = sum(len(a["token_ids"]) for pair in answers for a in pair)
            out[f"tps_{level}"] = tokens / (time.perf_counter() - t0)
    print("  " + ", ".join(f"{k} {v:.1f}" for k, v in out.items()), flush=True)
    return out


def prompts() -> list[str]:
    from loadgen.sharegpt import first_prompts
    return first_prompts(max(LEVELS) + SINGLE, seed=31, max_chars=300)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks side_by_side")
    parser.add_argument("--base", required=True, help="the commit to measure this working tree against")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--eager", action="store_true", help="decode steps eager in both arms (else as configured)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="the dtype both arms serve (else as configured)")
    args = parser.parse_args(argv)
    from benchmarks.report import git
    from contracts.config import load_settings
    from contracts.paths import REPO_ROOT

    base = git(REPO_ROOT, "rev-parse", "--verify", f"{args.base}^{{commit}}")
    if not base:
        raise SystemExit(f"no commit {args.base!r} in this repository")
    changes = {**({"compile": False} if args.eager else {}), **({"dtype": args.dtype} if args.dtype else {})}
    worktree = Path(tempfile.mkdtemp(prefix="quart-base-"))
    subprocess.run(["git", "worktree", "add", "--detach", "--force", str(worktree), base], cwd=REPO_ROOT, check=True,
                   capture_output=True)
    trees = {"base": worktree, "new": REPO_ROOT}
    settings = load_settings()
    models = str(settings.models_dir)
    try:
        rounds = []
        for r in range(args.rounds):
            order = ARMS if r % 2 == 0 else ARMS[::-1]
            rounds.append({arm: _run_arm(trees[arm], models, changes, f"round {r + 1}/{args.rounds}: {arm}")
                           for arm in order})
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=REPO_ROOT, capture_output=True)
        shutil.rmtree(worktree, ignore_errors=True)
    changed = git(REPO_ROOT, "log", "--oneline", f"{base}..HEAD")
    name = f"side_by_side_{args.dtype}" if args.dtype else "side_by_side"
    return report(name, rounds, ARMS, f"this tree against {base[:9]}, side by side",
                  base=base, commits_since_base=changed.splitlines(), eager=args.eager,
                  dtype=args.dtype or settings.compute.dtype)


def _run_arm(tree: Path, models: str, changes: dict, title: str) -> dict[str, float]:
    print(title, flush=True)
    env = {**os.environ, "PYTHONPATH": str(tree), "QUART_MODELS": models}
    results = []
    with subprocess.Popen([sys.executable, __file__, "--arm", json.dumps(changes)], cwd=tree, env=env,
                          stdout=subprocess.PIPE, text=True) as arm:
        for line in arm.stdout:  # its progress as it comes
            if line.startswith(RESULT):
                results.append(json.loads(line[len(RESULT):]))
            else:
                print(line, end="", flush=True)
    if arm.returncode != 0 or not results:
        raise SystemExit(f"the arm in {tree} failed (exit {arm.returncode}); its output is above")
    return results[-1]


def report(name: str, rounds: list[dict[str, dict[str, float]]], arms: tuple[str, str], title: str,
           **conds: object) -> dict:
    """Each figure per arm (medians over rounds) and the ratio second/first arm per round, its
    mean with a 95 % interval and what it shows; written as `name`, with a plot."""
    from benchmarks.report import conditions, mean_ci95, table, write

    figures, rows = [], []
    first, second = arms
    for key, (label, unit, higher_better) in _measured(rounds, arms).items():
        for arm in arms:
            values = [r[arm][key] for r in rounds]
            figures.append({"name": f"{label}, {arm}", "value": round(statistics.median(values), 3),
                            "unit": unit, "per_round": [round(v, 3) for v in values]})
        ratios = [r[second][key] / r[first][key] for r in rounds]
        mean, half = mean_ci95(ratios)
        outcome = _outcome(mean, half, higher_better)
        figures.append({"name": f"{label}, {second}/{first}", "value": round(mean, 3), "unit": "ratio",
                        "ci95": [round(mean - half, 3), round(mean + half, 3)],
                        "per_round": [round(x, 3) for x in ratios], "verdict": outcome})
        rows.append([label, unit, *(statistics.median(r[a][key] for r in rounds) for a in arms),
                     f"{mean:.3f} [{mean - half:.3f}, {mean + half:.3f}]", outcome])
    print(table(f"{title} (medians over rounds; {second}/{first} mean with 95 % interval)",
                ["figure", "unit", first, second, f"{second}/{first}", "verdict"], rows))
    recorded = conditions(model=MODEL, stages=4, rounds=len(rounds), new_tokens=NEW, loaded_new_tokens=LOADED_NEW,
                          single_requests=SINGLE, levels=list(LEVELS),
                          order=f"{first}, {second} in odd rounds; {second}, {first} in even",
                          runtimes="one per arm per round", **conds)
    write(name, figures, recorded)
    _plot(name, rounds, arms)
    return {"figures": figures, "conditions": recorded}


def _measured(rounds: list[dict[str, dict[str, float]]], arms: tuple[str, str]) -> dict:
    """The FIGURES every arm of every round measured (a base commit's arm may predate one)."""
    return {k: v for k, v in FIGURES.items() if all(k in r[a] for r in rounds for a in arms)}


def _outcome(mean: float, half: float, higher_better: bool) -> str:
    """A gain: TPOT lower (a ratio below 1) or throughput higher (above 1), the whole interval
    strictly past 1; a loss the other way; else no difference shown."""
    low, high = mean - half, mean + half
    if low > 1.0 or high < 1.0:
        return "gain" if (low > 1.0) == higher_better else "loss"
    return "no difference shown"


def _plot(name: str, rounds: list[dict[str, dict[str, float]]], arms: tuple[str, str]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.report import RESULTS
    figures = _measured(rounds, arms)
    fig, axes = plt.subplots(1, len(figures), figsize=(4 * len(figures), 3.6))
    x = range(1, len(rounds) + 1)
    for ax, (key, (label, unit, _)) in zip(axes, figures.items()):
        for arm, style in zip(arms, ("s--", "o-")):
            ax.plot(x, [r[arm][key] for r in rounds], style, label=arm)
        ax.set(xlabel="round", ylabel=unit, title=label, xticks=list(x))
        ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=110)
    plt.close(fig)


def _arm(changes: str) -> None:
    """One arm, in the tree this process runs in: its figures on the RESULT line."""
    print(RESULT + json.dumps(measure(prompts(), **json.loads(changes))), flush=True)


if __name__ == "__main__":
    _arm(sys.argv[2]) if sys.argv[1:2] == ["--arm"] else main(sys.argv[1:])
