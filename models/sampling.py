"""Choosing the next token from the last stage's logits. Greedy at temperature 0; otherwise
temperature and nucleus (top-p) sampling from a generator seeded by the request's seed and the
token's position, so a step computed again (on another replica, after a failure) picks the same
token, and a request with a seed is reproducible."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

import torch


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    logprobs: int = -1     # the chosen token's log-probability and this many likeliest tokens' (-1: none)
    choices: int = 1       # a prefill samples this many first tokens, choice i with seed + i

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Sampling:
        return cls(float(data.get("temperature", 0.0)), float(data.get("top_p", 1.0)), int(data.get("seed", 0)),
                   int(data.get("logprobs", -1)), int(data.get("choices", 1)))



def all_finite(logits: torch.Tensor) -> bool:
    """Whether no logit is NaN or infinite: whether the smallest and the largest are finite (a
    NaN anywhere makes both NaN, an infinity makes one of them infinite). One
    vectorised pass: torch.isfinite(...).all() took 120 µs over a 49,152-token vocabulary in
    bfloat16 on one thread of a Xeon, this 14."""
    return bool(torch.isfinite(torch.stack(torch.aminmax(logits))).all())


def next_token(logits: torch.Tensor, sampling: Sampling, position: int) -> int:
    """The token at `position` (the index it will have in the sequence) from logits [vocab]."""
    if sampling.temperature <= 0.0:
        # In float32: the same token (the conversion is exact), and torch's bfloat16 argmax took
        # 170 µs over a 49,152-token vocabulary on one thread of a Xeon where this takes 75.
        return int(logits.float().argmax())
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        ordered, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
        outside = ordered.cumsum(0) - ordered >= sampling.top_p
        ordered[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, ordered)
    generator = torch.Generator().manual_seed((sampling.seed * 1_000_003 + position) % (2 ** 63))
    return int(torch.multinomial(probs, 1, generator=generator))


@dataclass
class TokenLogprob:
    """One generated token's log-probability and, when asked, the likeliest tokens at its position
    with theirs (the last stage computes them; the entry reports them)."""
    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def sample(logits: torch.Tensor, sampling: Sampling, position: int, choices: int = 1) -> dict[str, torch.Tensor]:
    """The last stage's answer to a step: `token` [choices] (choice i sampled with seed + i) and,
    when the sampling asks, each one's log-probability [choices] with the `logprobs` likeliest
    tokens and theirs [choices, k], from the model's own distribution (the logits before
    temperature, as vLLM reports them)."""
    # Chosen on the CPU whatever device computed the logits: a seed then picks the same token on
    # every device (torch's generators differ between CPU and CUDA), and the answer goes there anyway.
    logits = logits.cpu()
    tokens = [next_token(logits, replace(sampling, seed=sampling.seed + i), position) for i in range(choices)]
    out = {"token": torch.tensor(tokens)}
    if sampling.logprobs >= 0:
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        values, ids = logprobs.topk(sampling.logprobs)
        out.update({"logprob": logprobs[tokens], "top_ids": ids.expand(choices, -1).contiguous(),
                    "top_logprobs": values.expand(choices, -1).contiguous()})
    return out


def answers(out: dict[str, torch.Tensor]) -> list[tuple[int, TokenLogprob | None]]:
    """Each choice's token and its log-probabilities (None where none were asked for), from a
    last stage's answer."""
    tokens = out["token"].tolist()
    if "logprob" not in out:
        return [(t, None) for t in tokens]
    return [(t, TokenLogprob(t, float(lp), list(zip(ids, values))))
            for t, lp, ids, values in zip(tokens, out["logprob"].tolist(), out["top_ids"].tolist(),
                                          out["top_logprobs"].tolist())]
