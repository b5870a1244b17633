"""The requests of a replay: when each is sent, to which model, with which body. Prompts are real
ShareGPT opening turns sampled with the seed; where a trace gives a prompt length, the prompt
whose length is nearest is used, and the answer length becomes `max_new_tokens`."""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from models.profiles import PROFILES

CHARS_PER_TOKEN = 4.0  # English text in a LLaMA-family tokenizer; only used to match lengths


@dataclass(frozen=True)
class Request:
    index: int
    at: float            # seconds after the start
    model: str
    body: dict
    prompt_tokens: int   # estimated
    max_new_tokens: int


def kind_of(model: str) -> str:
    """How a model is called: "emulated" ({"tokens": n}), "embed" ({"inputs": [...]}) or
    "generate" ({"prompt", "max_new_tokens"})."""
    if model in PROFILES:
        return "emulated"
    return "embed" if "minilm" in model else "generate"


def as_openai(r: Request) -> Request:
    """A generation request as an OpenAI completion (for an OpenAI-compatible server): the same
    prompt and length, greedy, end of text ignored (vLLM's extra field, which this project's
    endpoint also takes), streamed with its usage at the end, so that the replay times the first
    token. ValueError for a request that is not a generation."""
    if "prompt" not in r.body:
        raise ValueError(f"{r.model}: only generative models' requests can go to an OpenAI-compatible server")
    body = {"model": r.model, "prompt": r.body["prompt"], "max_tokens": r.max_new_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    return Request(r.index, r.at, r.model, body, r.prompt_tokens, r.max_new_tokens)


class PromptPool:
    def __init__(self, prompts: list[str]) -> None:
        if not prompts:
            raise ValueError("no prompts")
        self.prompts = sorted(prompts, key=len)
        self.tokens = [max(1, round(len(p) / CHARS_PER_TOKEN)) for p in self.prompts]

    @classmethod
    def sharegpt(cls, count: int = 2000, seed: int = 0, max_chars: int = 2000) -> PromptPool:
        from loadgen.sharegpt import first_prompts
        return cls(first_prompts(count, seed=seed, max_chars=max_chars, pool=count * 3))

    def pick(self, rng: np.random.Generator, tokens: int | None = None) -> tuple[str, int]:
        """A random prompt, or one of the few nearest to `tokens` long."""
        if tokens is None:
            i = int(rng.integers(len(self.prompts)))
        else:
            at = bisect.bisect_left(self.tokens, tokens)
            lo, hi = max(0, at - 2), min(len(self.prompts), at + 3)
            i = int(rng.integers(lo, max(lo + 1, hi)))
        return self.prompts[i], self.tokens[i]


def build(times: dict[str, np.ndarray], pool: PromptPool | None, seed: int, max_new_tokens: int = 1,
          prompt_tokens: dict[str, np.ndarray] | None = None, answer_tokens: dict[str, np.ndarray] | None = None,
          emulated_tokens: int = 16, max_emulated_tokens: int = 2048) -> list[Request]:
    """Requests for each model's arrival times, sorted by time. `prompt_tokens`/`answer_tokens`
    (from a trace, per model, aligned with its times) pick prompt lengths and answer lengths."""
    rng = np.random.default_rng(seed)
    merged = sorted((float(t), model, i) for model, ts in times.items() for i, t in enumerate(ts))
    out = []
    for index, (at, model, i) in enumerate(merged):
        want = int(prompt_tokens[model][i]) if prompt_tokens and model in prompt_tokens else None
        new = int(answer_tokens[model][i]) if answer_tokens and model in answer_tokens else max_new_tokens
        kind = kind_of(model)
        if kind == "emulated":
            tokens = min(max_emulated_tokens, want or emulated_tokens)
            out.append(Request(index, at, model, {"tokens": tokens}, tokens, 0))
            continue
        if pool is None:
            raise ValueError(f"{model} needs prompts")
        prompt, tokens = pool.pick(rng, want)
        body = {"inputs": [prompt]} if kind == "embed" else {"prompt": prompt, "max_new_tokens": max(1, new)}
        out.append(Request(index, at, model, body, tokens, 0 if kind == "embed" else max(1, new)))
    return out
