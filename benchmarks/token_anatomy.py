"""Where one request's decode token goes in the 4-stage SmolLM2 pipeline, from the stages' own
records: each stage's step, each stage's time around its step (woken by the stream, the step's
inputs and outputs, the commit that hands the token on), and the way back to stage 0: from the
last stage's hand-on to the next step's arrival at stage 0 (the entry's turn where the entry sends
each step; none where the last stage sends it, QUART_CHAIN_STEPS).

    python -m benchmarks token_anatomy

One request at a time, 64 new tokens (end of text ignored), 5 requests on ShareGPT prompts, the
embedded runtime as the generation benchmark starts it (one replica per stage, the served dtype
as configured), once per mode: eager steps, compiled steps on one thread each, and compiled steps
on the host's idle cores (QUART_IDLE_CORES=all) sent by the entry, then by the last stage (the
default: every step of the other modes too). A stage's record of a step says when the step's
message entered its stream (the stream ID), how long it waited there, how long the step took and
when the record was written, in the same transaction as the hand-on (the record stream's ID). Stream IDs count milliseconds,
so a stage's time from arrival to hand-on is exact to a millisecond on each step and the medians
are finer; how that time splits between waiting and the rest is not (the wait is measured
from the arrival's millisecond), so the two are reported together."""
from __future__ import annotations

import statistics
import time
from collections import defaultdict

from benchmarks.generation import STAGES, THREADS, decode_steps, pipeline_request, running
from benchmarks.report import RESULTS, SERVING, conditions, mean_ci95, table, write
from contracts.config import load_settings
from contracts.http_client import GatewayClient
from loadgen.sharegpt import first_prompts
from state.records import StageSample
from state.store import RedisStore

MEASURES = SERVING + ("loadgen", "benchmarks/generation.py")  # the code measured (benchmarks/freshness.py)

MODEL, NEW, REQUESTS = "smollm2", 64, 5


# Each mode's settings: eager decode steps on one thread each; compiled ones on one thread each;
# compiled ones on the host's idle cores (QUART_IDLE_CORES=all), each sent by the entry; and the
# same sent by the last stage (the default).
MODES = {"eager": {"compile": False}, "compiled": {"compile": True, "idle_cores": "prefill"},
         "compiled, idle cores, sent by the entry": {"compile": True, "idle_cores": "all", "chain_steps": False},
         "compiled, idle cores": {"compile": True, "idle_cores": "all"}}
# The side-by-side comparison of where the next step comes from (modes of MODES).
CHAINED, SENT = "compiled, idle cores", "compiled, idle cores, sent by the entry"
BACK = "back to stage 0"


def main() -> dict:
    """Each of MODES on the same prompts, one runtime each."""
    texts = first_prompts(REQUESTS, seed=29, max_chars=300)
    modes = {}
    for mode, changes in MODES.items():
        print(f"{mode} decode steps:", flush=True)
        modes[mode] = _measure(texts, changes)
    return _report(modes, load_settings().compute.dtype)


def _measure(texts: list[str], changes: dict[str, bool]) -> list[dict[str, float]]:
    per_request = []
    with running(MODEL, NEW, **changes) as settings:
        client = GatewayClient(settings.gateway.url, timeout=600)
        store = RedisStore.from_url(settings.redis_url)
        for i, text in enumerate(texts):
            print(f"  request {i + 1}/{len(texts)}", flush=True)
            since = time.time() - 1.0
            rid = pipeline_request(client, MODEL, text, NEW)["id"]
            steps = decode_steps(store, MODEL, rid, since)
            if changes["compile"] and not all(s.compiled for step in steps for s in step):
                raise SystemExit("a decode step ran eager after the stages had compiled")
            per_request.append(anatomy(steps))
    return per_request


def anatomy(steps: list[list[StageSample]]) -> dict[str, float]:
    """Medians over one request's decode steps (ms): the token period at stage 0, and per stage
    its step and the rest of its time from arrival to hand-on, and the way back to stage 0."""
    out: dict[str, list[float]] = defaultdict(list)
    for k, step in enumerate(steps):
        for i, s in enumerate(step):
            out[f"stage {i} step"].append(s.service_ms)
            out[f"stage {i} around the step"].append(s.at_ms - s.arrived_at * 1000.0 - s.service_ms)
        if k + 1 < len(steps):
            following = steps[k + 1][0].arrived_at * 1000.0
            out[BACK].append(following - step[-1].at_ms)
            out["token period"].append(following - step[0].arrived_at * 1000.0)
    return {"decode steps": float(len(steps)), **{name: statistics.median(values) for name, values in out.items()}}


def _report(modes: dict[str, list[dict[str, float]]], dtype: str) -> dict:
    figures, summaries = [], {}
    for mode, per_request in modes.items():
        summary, more = _summarise(mode, per_request)
        summaries[mode] = summary
        # The eager figures keep the names they had before compiled steps were measured beside them.
        prefix = "" if mode == "eager" else f"{mode}: "
        figures += [{**f, "name": prefix + f["name"]} for f in more]
    steps = {m: sum(summary[f"stage {i} step"][0] for i in range(STAGES)) for m, summary in summaries.items()}
    for mode in list(MODES)[1:]:
        ratio = summaries[mode]["token period"][0] / summaries["eager"]["token period"][0]
        print(f"{mode} / eager: token period {ratio:.2f}x, steps {steps[mode] / steps['eager']:.2f}x")
        figures += [{"name": f"token period, {mode} / eager", "value": round(ratio, 3), "unit": "x"},
                    {"name": f"steps, {mode} / eager", "value": round(steps[mode] / steps["eager"], 3), "unit": "x"}]
    # Per prompt (the modes ran the same ones), side by side.
    mean, half = mean_ci95([c["token period"] / s["token period"] for c, s in zip(modes[CHAINED], modes[SENT])])
    print(f"token period, the next step sent by the last stage / by the entry: {mean:.3f}x "
          f"({mean - half:.3f}..{mean + half:.3f})")
    figures.append({"name": "token period, sent by the last stage / by the entry", "value": round(mean, 3), "unit": "x",
                    "ci95": [round(mean - half, 3), round(mean + half, 3)]})
    write("token_anatomy", figures, conditions(model=MODEL, stages=STAGES, new_tokens=NEW, requests=REQUESTS,
                                               dtype=dtype, threads_per_replica=THREADS, decoding="greedy, end of text ignored",
                                               modes={m: c for m, c in MODES.items()}, runtimes="one per mode"))
    _plot(summaries)
    return summaries


def _summarise(mode: str, per_request: list[dict[str, float]]) -> tuple[dict, list[dict]]:
    counted = [int(r.pop("decode steps")) for r in per_request]
    summary = {name: mean_ci95([r[name] for r in per_request]) for name in per_request[0]}
    steps = sum(summary[f"stage {i} step"][0] for i in range(STAGES))
    between = sum(summary[f"stage {i} around the step"][0] for i in range(STAGES)) + summary[BACK][0]
    rows = [[name, mean, f"{mean - half:.2f}..{mean + half:.2f}"] for name, (mean, half) in summary.items()]
    print(table(f"one request's decode token, {MODEL} in {STAGES} stages, {mode} steps (ms; mean of "
                f"{len(per_request)} requests' medians, 95 % interval)", ["part", "ms", "95 % interval"], rows))
    period = summary["token period"][0]
    print(f"decode steps recorded at every stage, per request: {counted}")
    print(f"steps {steps:.2f} ms ({steps / period:.0%} of the period), between them {between:.2f} ms "
          f"({between / period:.0%})")
    figures = [{"name": name, "value": round(mean, 3), "unit": "ms", "ci95": [round(mean - half, 3), round(mean + half, 3)]}
               for name, (mean, half) in summary.items()]
    figures += [{"name": "decode steps per request, fewest", "value": min(counted), "unit": "steps"},
                {"name": "steps, all stages", "value": round(steps, 3), "unit": "ms"},
                {"name": "between the steps", "value": round(between, 3), "unit": "ms"}]
    return summary, figures


def _plot(summaries: dict[str, dict[str, tuple[float, float]]]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 3.8))
    for row, summary in enumerate(summaries.values()):
        left = 0.0
        for i in range(STAGES):
            for part, color in (("step", "tab:blue"), ("around the step", "tab:orange")):
                width = summary[f"stage {i} {part}"][0]
                ax.barh(row, width, left=left, color=color, edgecolor="white", label=part if i == row == 0 else None)
                if part == "step":
                    ax.text(left + width / 2, row, f"s{i}", ha="center", va="center", color="white")
                left += width
        ax.barh(row, summary[BACK][0], left=left, color="tab:grey", edgecolor="white",
                label=BACK if row == 0 else None)
    ax.set(xlabel="ms", yticks=range(len(summaries)), yticklabels=[f"{m} steps" for m in summaries],
           title=f"one decode token of {MODEL} in {STAGES} stages, one request in flight")
    ax.invert_yaxis()
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3, frameon=False)
    fig.tight_layout()
    fig.savefig(RESULTS / "token_anatomy.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
