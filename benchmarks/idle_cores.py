"""Whether a stage step should take the host's idle cores (QUART_IDLE_CORES), measured side by
side: the 4-stage SmolLM2 pipeline with it off and on, alternately, in rounds (off then on in even
rounds, on then off in odd ones), so that a VM whose speed drifts within the hour weighs on both
arms alike. Each round compares the two arms it ran back to back.

    python -m benchmarks idle_cores [--rounds 3]

Per arm, one runtime (one replica per stage, compiled steps as configured): the time per output
token and to the first token of single requests (ShareGPT prompts, 96 new tokens, end of text
ignored, one at a time), then the tokens per second of 4 and 16 concurrent requests (each client
sends two of 32 tokens). Reported: each figure per arm, and per round the ratio on/off, with the mean ratio's 95 % interval
over the rounds; "gain" only where the whole interval is on the better side of 1."""
from __future__ import annotations

import argparse

from benchmarks import side_by_side
from benchmarks.report import SERVING

MEASURES = SERVING + ("loadgen", "benchmarks/generation.py")  # the code measured (benchmarks/freshness.py)

ARMS = ("off", "on")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks idle_cores")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    texts = side_by_side.prompts()
    rounds = []
    for r in range(args.rounds):
        order = ARMS if r % 2 == 0 else ARMS[::-1]
        measured = {}
        for arm in order:
            print(f"round {r + 1}/{args.rounds}: idle cores {arm}", flush=True)
            measured[arm] = side_by_side.measure(texts, idle_cores=arm == "on")
        rounds.append(measured)
    return side_by_side.report("idle_cores", rounds, ARMS, "idle cores off and on, side by side")


if __name__ == "__main__":
    main()
