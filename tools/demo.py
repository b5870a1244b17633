"""The main job: start the embedded runtime, answer real ShareGPT prompts through the pipelined
SmolLM2 and MiniLM, print the answers with per-stage timings, and stop everything."""
from __future__ import annotations

import argparse
import sys

from contracts.config import add_arguments, exit_on_config_error, settings_from_args
from contracts.http_client import GatewayClient
from loadgen.sharegpt import first_prompts
from runtime import __main__ as control


def _stage_line(stages: list[dict]) -> str:
    return "  ".join(f"s{s['stage']} q{s['queue_ms']:.0f}/c{s['service_ms']:.0f}ms" for s in stages)


def run(client: GatewayClient, prompts: list[str], max_new_tokens: int) -> int:
    failures = 0
    print(f"\n== smollm2: {len(prompts)} ShareGPT prompts, {max_new_tokens} new tokens each ==")
    for i, prompt in enumerate(prompts, 1):
        reply = client.invoke("smollm2", {"messages": [{"role": "user", "content": prompt}],
                                          "max_new_tokens": max_new_tokens})
        print(f"\n[{i}] user: {prompt}")
        if reply.status != 200:
            failures += 1
            print(f"    error {reply.status}: {reply.body.decode(errors='replace')}")
            continue
        answer = reply.json()
        print(f"    smollm2: {answer['text'].strip()}")
        print(f"    {answer['latency_ms']:.0f} ms for {len(answer['token_ids'])} tokens; "
              f"per stage (queue/compute, summed over passes): {_stage_line(answer['stages'])}")
    print(f"\n== minilm: embeddings of the same {len(prompts)} prompts ==")
    reply = client.invoke("minilm", {"inputs": prompts})
    if reply.status != 200:
        print(f"error {reply.status}: {reply.body.decode(errors='replace')}")
        return failures + 1
    answer = reply.json()
    vectors = answer["embeddings"]
    print(f"{len(vectors)} vectors of {len(vectors[0])} dims in {answer['latency_ms']:.0f} ms; "
          f"per stage: {_stage_line(answer['stages'])}")
    print("cosine similarity of prompt 1 to each prompt: " +
          " ".join(f"{sum(a * b for a, b in zip(vectors[0], v)):.2f}" for v in vectors))
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    add_arguments(parser, "home", "gateway_port", "redis_port", "stack_file")
    args = parser.parse_args(argv)
    settings = exit_on_config_error(lambda: settings_from_args(args))
    if control.up(settings, timeout=600) != 0:
        return 1
    try:
        failures = run(GatewayClient.for_settings(settings), first_prompts(args.prompts, args.seed),
                       args.max_new_tokens)
    finally:
        control.down(settings)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
