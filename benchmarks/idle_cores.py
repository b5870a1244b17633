"""Whether a stage step should take the host's idle cores (QUART_IDLE_CORES), measured side by
side: the 4-stage SmolLM2 pipeline with it off and on, alternately, in rounds (off then on in even
rounds, on then off in odd ones), so that a VM whose speed drifts within the hour weighs on both
arms alike. Each round compares the two arms it ran back to back.

    python -m benchmarks idle_cores [--rounds 3]

Per arm, one runtime (one replica per stage, compiled steps as configured): the time per output
token of single requests (ShareGPT prompts, 96 new tokens, end of text ignored, one at a time),
then the tokens per second of 4 and 16 concurrent requests (each client sends two of 32 tokens).
Reported: each figure per arm, and per round the ratio on/off, with the mean ratio's 95 % interval
over the rounds; "gain" only where the whole interval is on the better side of 1."""
from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from benchmarks.generation import pipeline_request, running
from benchmarks.report import RESULTS, SERVING, conditions, mean_ci95, table, verdict, write
from contracts.http_client import GatewayClient
from loadgen.sharegpt import first_prompts

MEASURES = SERVING + ("loadgen", "benchmarks/generation.py")  # the code measured (benchmarks/freshness.py)

MODEL, NEW, LOADED_NEW, SINGLE = "smollm2", 96, 32, 4
LEVELS = (4, 16)
ARMS = ("off", "on")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks idle_cores")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    texts = first_prompts(max(LEVELS) + SINGLE, seed=31, max_chars=300)
    rounds = []
    for r in range(args.rounds):
        order = ARMS if r % 2 == 0 else ARMS[::-1]
        measured = {}
        for arm in order:
            print(f"round {r + 1}/{args.rounds}: idle cores {arm}", flush=True)
            measured[arm] = _measure(texts, arm == "on")
        rounds.append(measured)
    return _report(rounds)


def _measure(texts: list[str], idle_cores: bool) -> dict[str, float]:
    with running(MODEL, NEW, idle_cores=idle_cores) as settings:
        client = GatewayClient(settings.gateway.url, timeout=600)
        tpots = [pipeline_request(client, MODEL, text, NEW)["tpot_ms"] for text in texts[:SINGLE]]
        out = {"tpot_ms": statistics.median(tpots)}
        for level in LEVELS:
            t0 = time.perf_counter()
            with ThreadPoolExecutor(level) as pool:
                answers = list(pool.map(lambda t: [pipeline_request(client, MODEL, t, LOADED_NEW) for _ in range(2)],
                                        texts[SINGLE:SINGLE + level]))
            tokens = sum(len(a["token_ids"]) for pair in answers for a in pair)
            out[f"tps_{level}"] = tokens / (time.perf_counter() - t0)
    print("  " + ", ".join(f"{k} {v:.1f}" for k, v in out.items()), flush=True)
    return out


FIGURES = {"tpot_ms": ("TPOT, one request at a time", "ms", False),
           **{f"tps_{level}": (f"throughput, {level} concurrent", "tokens/s", True) for level in LEVELS}}


def _report(rounds: list[dict[str, dict[str, float]]]) -> dict:
    figures, rows = [], []
    for key, (label, unit, higher_better) in FIGURES.items():
        for arm in ARMS:
            values = [r[arm][key] for r in rounds]
            figures.append({"name": f"{label}, idle cores {arm}", "value": round(statistics.median(values), 3),
                            "unit": unit, "per_round": [round(v, 3) for v in values]})
        ratios = [r["on"][key] / r["off"][key] for r in rounds]
        mean, half = mean_ci95(ratios)
        # A gain: TPOT lower (ratio below 1) or throughput higher (above 1), the whole interval past 1.
        said = verdict(mean, half, 1.0, at_least=higher_better)
        outcome = {"met": "gain", "missed": "loss"}.get(said, "no difference shown")
        figures.append({"name": f"{label}, on/off", "value": round(mean, 3), "unit": "ratio",
                        "ci95": [round(mean - half, 3), round(mean + half, 3)],
                        "per_round": [round(x, 3) for x in ratios], "verdict": outcome})
        rows.append([label, unit, *(statistics.median(r[a][key] for r in rounds) for a in ARMS),
                     f"{mean:.3f} [{mean - half:.3f}, {mean + half:.3f}]", outcome])
    print(table("idle cores off and on, side by side (medians over rounds; on/off mean with 95 % interval)",
                ["figure", "unit", "off", "on", "on/off", "verdict"], rows))
    conds = conditions(model=MODEL, stages=4, rounds=len(rounds), new_tokens=NEW, loaded_new_tokens=LOADED_NEW,
                       single_requests=SINGLE, levels=list(LEVELS), order="off, on in even rounds; on, off in odd",
                       runtimes="one per arm per round")
    write("idle_cores", figures, conds)
    _plot(rounds)
    return {"figures": figures, "conditions": conds}


def _plot(rounds: list[dict[str, dict[str, float]]]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(FIGURES), figsize=(4 * len(FIGURES), 3.6))
    x = range(1, len(rounds) + 1)
    for ax, (key, (label, unit, _)) in zip(axes, FIGURES.items()):
        for arm, style in zip(ARMS, ("s--", "o-")):
            ax.plot(x, [r[arm][key] for r in rounds], style, label=f"idle cores {arm}")
        ax.set(xlabel="round", ylabel=unit, title=label, xticks=list(x))
        ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "idle_cores.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
