"""The main job: start the embedded runtime, answer real ShareGPT prompts through the pipelined
SmolLM2 (one at a time, then a chat streamed through the OpenAI client, then a batch at once) and
MiniLM, print the answers with their timings, and stop everything."""
from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor

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
        print(f"    {answer['latency_ms']:.0f} ms for {len(answer['token_ids'])} tokens (first token "
              f"{answer['ttft_ms']:.0f} ms, then {answer['tpot_ms']:.0f} ms a token); per stage "
              f"(queue/compute, summed over steps): {_stage_line(answer['stages'])}")
    failures += stream_one(client, prompts[0], max_new_tokens)
    failures += all_at_once(client, prompts, max_new_tokens)
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


def stream_one(client: GatewayClient, prompt: str, max_new_tokens: int) -> int:
    """The same pipeline through OpenAI's client, streamed as it is generated."""
    import openai
    oai = openai.OpenAI(base_url=f"{client.url}/v1", api_key="unused", max_retries=0)  # every model, one base URL
    print(f"\n== smollm2 through the openai client, streamed ==\nuser: {prompt}\nsmollm2: ", end="", flush=True)
    try:
        for chunk in oai.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": prompt}],
                                                 max_tokens=max_new_tokens, temperature=0.7, seed=1, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                print(chunk.choices[0].delta.content, end="", flush=True)
    except openai.OpenAIError as exc:
        print(f"\n    error: {exc}")
        return 1
    print()
    return 0


def all_at_once(client: GatewayClient, prompts: list[str], max_new_tokens: int) -> int:
    """Every prompt at the same time: the stage replicas batch their steps."""
    body = [{"messages": [{"role": "user", "content": p}], "max_new_tokens": max_new_tokens} for p in prompts]
    started = time.perf_counter()
    with ThreadPoolExecutor(len(body)) as pool:
        replies = list(pool.map(lambda b: client.invoke("smollm2", b), body))
    elapsed = time.perf_counter() - started
    ok = [r.json() for r in replies if r.status == 200]
    tokens = sum(len(a["token_ids"]) for a in ok)
    print(f"\n== smollm2: the {len(prompts)} prompts at once ==\n{len(ok)} answered, {tokens} tokens in "
          f"{elapsed:.1f} s ({tokens / elapsed:.1f} tokens/s, batched in the stage replicas)")
    return len(replies) - len(ok)


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
