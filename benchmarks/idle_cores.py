"""Which stage steps should take the host's idle cores (QUART_IDLE_CORES), measured side by side:
the 4-stage SmolLM2 pipeline with `off` and with a mode, alternately, in rounds (off then the mode
in odd rounds, the mode then off in even ones), so that a VM whose speed drifts within the hour
weighs on both arms alike. Each round compares the two arms it ran back to back.

    python -m benchmarks idle_cores [--rounds 3]               # off against all, the default (idle_cores.json)
    python -m benchmarks idle_cores --mode prefill [--rounds 3] # off against prefill (idle_cores_prefill.json)

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


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks idle_cores")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mode", choices=["all", "prefill"], default="all", help="the arm measured against off")
    args = parser.parse_args(argv)
    arms = ("off", args.mode)
    texts = side_by_side.prompts()
    rounds = []
    for r in range(args.rounds):
        order = arms if r % 2 == 0 else arms[::-1]
        measured = {}
        for arm in order:
            print(f"round {r + 1}/{args.rounds}: idle cores {arm}", flush=True)
            measured[arm] = side_by_side.measure(texts, idle_cores=arm)
        rounds.append(measured)
    name = "idle_cores" if args.mode == "all" else f"idle_cores_{args.mode}"
    return side_by_side.report(name, rounds, arms, f"idle cores off and {args.mode}, side by side")


if __name__ == "__main__":
    main()
