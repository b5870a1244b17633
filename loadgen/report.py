"""The evaluation report: one Markdown file with the tables, PNG plots beside it (latency CDF, SLO
attainment against SLO scale, per-stage timelines, CV and mean queue per stage) and the summary as
JSON. Every request is kept as JSON lines apart from the report (under QUART_HOME/records: they
are large, and a report's folder is what gets committed), so the figures can be redrawn without
re-running where they are present:

    python -m loadgen.report REPORT_DIR [--home QUART_HOME]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

from loadgen.client import Record


def _ms(x: float) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * 1000:.0f}"


def _fmt(x: float, digits: int = 2) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def markdown(title: str, conditions: dict, runs: dict[str, dict]) -> str:
    lines = [f"# {title}", "", "Conditions: " + ", ".join(f"{k}={v}" for k, v in conditions.items()), ""]
    scales = list(next(iter(runs.values()))["summary"]["slo_attainment"]) if runs else []
    head = (["policy", "sent", "ok", "mean ms", "p50", "p75", "p90", "p99"] + [f"SLO {s}×" for s in scales]
            + ["goodput req/s", "goodput tok/s", "replica-s"])
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for policy, run in runs.items():
        s = run["summary"]
        lat = s["latency_s"]
        row = ([policy, str(s["sent"]), str(s["ok"]), _ms(lat["mean"]), _ms(lat["p50"]), _ms(lat["p75"]),
                _ms(lat["p90"]), _ms(lat["p99"])] + [f"{100 * s['slo_attainment'][k]:.1f} %" for k in scales]
               + [_fmt(s["goodput"]["requests_per_s"]), _fmt(s["goodput"]["tokens_per_s"], 1),
                  _fmt(s["replica_seconds"], 0)])
        lines.append("| " + " | ".join(row) + " |")
    tokens = {policy: run["summary"]["tokens"] for policy, run in runs.items() if "tokens" in run["summary"]}
    if tokens:
        t0 = next(iter(tokens.values()))
        lines += ["", f"Generations: TTFT and TPOT (ms), SLO attainment on each (TTFT SLO {_ms(t0['ttft_slo_s'])} ms, "
                  f"5× the warm TTFT; TPOT SLO {_ms(t0['tpot_slo_s'])} ms), and token goodput (output tokens/s of "
                  "requests that met both):", "",
                  "| policy | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | TTFT SLO | TPOT SLO | token goodput tok/s |",
                  "|---|---|---|---|---|---|---|---|"]
        for policy, t in tokens.items():
            lines.append(f"| {policy} | {_ms(t['ttft_s']['p50'])} | {_ms(t['ttft_s']['p99'])} | {_ms(t['tpot_s']['p50'])} | "
                         f"{_ms(t['tpot_s']['p99'])} | {100 * t['ttft_attainment']:.1f} % | {100 * t['tpot_attainment']:.1f} % | "
                         f"{_fmt(t['token_goodput_per_s'], 1)} |")
    first = next(iter(runs.values()), None)
    if first and first["timeline"].get("cv"):
        stages = len(first["timeline"]["cv"])
        lines += ["", "Observed inter-arrival CV per stage (QUART Fig. 2a) and mean queue length per stage (Fig. 2b):",
                  "", "| policy | " + " | ".join(f"CV s{i}" for i in range(stages)) + " | "
                  + " | ".join(f"queue s{i}" for i in range(stages)) + " |", "|" + "---|" * (1 + 2 * stages)]
        for policy, run in runs.items():
            t = run["timeline"]
            lines.append(f"| {policy} | " + " | ".join(_fmt(c) for c in t["cv"]) + " | "
                         + " | ".join(_fmt(q, 1) for q in t.get("mean_queue") or [math.nan] * stages) + " |")
    profiled = first["summary"]["profiled_s"] if first else math.nan
    lines += ["", f"Profiled (unloaded) latency: {_ms(profiled)} ms; goodput counts answers within "
              f"{first['summary']['slo_scale'] if first else 2:g}× that. SLO attainment counts failed requests "
              "as misses.", "", "![latency CDF](latency_cdf.png)", "![SLO attainment](slo_attainment.png)",
              *(["![timelines](timelines.png)", "![stages](stages.png)"] if _timelines(runs) else []), ""]
    return "\n".join(lines)


def plots(out: Path, runs: dict[str, dict]) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    paths = []
    if any(run["records"] for run in runs.values()):   # re-rendered without its records: the CDF stays as drawn
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for policy, run in runs.items():
            lat = np.sort([r.latency_s for r in run["records"] if r.ok])
            if len(lat):
                ax.plot(lat * 1000, np.arange(1, len(lat) + 1) / len(lat), label=policy)
        ax.set(xlabel="latency (ms)", ylabel="fraction of answered requests", title="Latency CDF")
        ax.grid(alpha=0.3)
        ax.legend()
        paths.append(_save(fig, out / "latency_cdf.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy, run in runs.items():
        att = run["summary"]["slo_attainment"]
        ax.plot([float(k) for k in att], [100 * v for v in att.values()], marker="o", label=policy)
    ax.set(xlabel="SLO scale (× profiled latency)", ylabel="SLO attainment (%)", title="SLO attainment", ylim=(0, 102))
    ax.grid(alpha=0.3)
    ax.legend()
    paths.append(_save(fig, out / "slo_attainment.png"))
    if not _timelines(runs):  # a replay against another server: its replicas and queues are not read
        return paths

    fig, axes = plt.subplots(len(runs), 3, figsize=(15, 2.8 * len(runs)), squeeze=False)
    for row, (policy, run) in enumerate(runs.items()):
        t = run["timeline"]
        for i, rate in enumerate(t.get("rate", [])):
            axes[row][0].plot(t["rate_t"], rate, lw=0.8, label=f"s{i}")
        for i, reps in enumerate(t.get("replicas", [])):
            axes[row][1].step(t["t"], reps, lw=0.8, where="post", label=f"s{i}")
        for i, queue in enumerate(t.get("queue", [])):
            axes[row][2].plot(t["t"], queue, lw=0.8, label=f"s{i}")
        for col, what in enumerate(("arrivals/s", "replicas", "queue length")):
            axes[row][col].set(title=f"{policy}: {what} per stage", xlabel="s")
            axes[row][col].grid(alpha=0.3)
        axes[row][1].legend(fontsize=6, ncol=2)
    paths.append(_save(fig, out / "timelines.png"))

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4))
    width = 0.8 / max(1, len(runs))
    for n, (policy, run) in enumerate(runs.items()):
        t = run["timeline"]
        x = np.arange(len(t.get("cv", [])))
        a.bar(x + n * width, t.get("cv", []), width, label=policy)
        b.bar(np.arange(len(t.get("mean_queue", []))) + n * width, t.get("mean_queue", []), width, label=policy)
    a.set(title="Observed inter-arrival CV per stage", xlabel="stage")
    b.set(title="Mean queue length per stage", xlabel="stage")
    a.legend(fontsize=7)
    paths.append(_save(fig, out / "stages.png"))
    return paths


def _timelines(runs: dict[str, dict]) -> bool:
    return any(run["timeline"] for run in runs.values())


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return path


def records_dir(home: Path, out: Path) -> Path:
    """Where a report's per-request records go: QUART_HOME/records/<the report's folder>, by its
    path inside the repository where it is there (two reports' folders may share a last name)."""
    from contracts.paths import REPO_ROOT
    out = out.resolve()
    name = out.relative_to(REPO_ROOT) if out.is_relative_to(REPO_ROOT) else Path(out.name)
    return Path(home) / "records" / name


def write(out: Path, title: str, conditions: dict, runs: dict[str, dict], home: Path) -> Path:
    """runs: policy -> {"summary": metrics.summarize(...), "timeline": timeline.timeline(...),
    "records": [Record]}; the records go under `home` (records_dir). Returns the Markdown file's path."""
    out.mkdir(parents=True, exist_ok=True)
    records = records_dir(home, out)
    records.mkdir(parents=True, exist_ok=True)
    for policy, run in runs.items():
        with open(records / f"records-{policy}.jsonl", "w") as f:
            for rec in run["records"]:
                f.write(rec.as_json() + "\n")
    (out / "results.json").write_text(json.dumps(
        {"title": title, "conditions": conditions,
         "runs": {p: {"summary": r["summary"], "timeline": r["timeline"]} for p, r in runs.items()}},
        indent=1, default=lambda x: None))
    return render(out, home)


def render(out: Path, home: Path) -> Path:
    """The report and plots from results.json, with the per-request records where `home` has them."""
    data = json.loads((out / "results.json").read_text())
    records = records_dir(home, out)
    runs = {p: {**r, "records": load_records(records / f"records-{p}.jsonl")
                if (records / f"records-{p}.jsonl").exists() else []} for p, r in data["runs"].items()}
    plots(out, runs)
    path = out / "report.md"
    path.write_text(markdown(data["title"], data["conditions"], runs))
    return path


def load_records(path: Path) -> list[Record]:
    return [Record(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> int:
    from contracts.config import load_settings
    parser = argparse.ArgumentParser(description="Draws a report again from its results.json (and its records, where kept).")
    parser.add_argument("report", type=Path, help="the report's folder (holding results.json)")
    parser.add_argument("--home", default=None, help="QUART_HOME, under whose records/ the per-request records are")
    a = parser.parse_args(argv)
    if not (a.report / "results.json").exists():
        print(f"{a.report} holds no results.json", file=sys.stderr)
        return 2
    print(f"report: {render(a.report, Path(load_settings(home=a.home).home))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
