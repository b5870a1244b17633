"""The OpenAI-compatible surface of a model's entry function: requests validated by the typed
models of `frontend/openai_protocol.py` and made into what the entry runs, and response bodies,
stream chunks, log-probabilities and error bodies in OpenAI's shapes. Pure: no I/O, no model."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from pydantic import ValidationError

from contracts.openai_errors import error_body  # noqa: F401 (the entry's error answers)
from contracts.wire import BadRequest
from frontend.openai_protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest, OpenAIBody
from models.sampling import Sampling, TokenLogprob

# Chat roles a model's chat template is given: `developer` is OpenAI's new name for `system`.
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


class OpenAIError(BadRequest):
    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message, status)
        self.param, self.code = param, code


@dataclass
class OpenAIRequest:
    chat: bool
    prompt: str | None
    messages: list[dict[str, str]] | None
    max_tokens: int
    sampling: Sampling
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False
    n: int = 1
    logprobs: bool = False          # each token's log-probability in the answer
    top_logprobs: int = 0           # and that many likeliest tokens at each position
    ignored: list[str] = field(default_factory=list)


def validated(model_class: type[OpenAIBody], body: bytes) -> OpenAIBody:
    """The body as `model_class`; OpenAIError naming the first field that is wrong."""
    try:
        return model_class.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        message = first["msg"].removeprefix("Value error, ")
        raise OpenAIError(f"{param}: {message}" if param else message, param=param) from None


def _check_model(requested: str, model: str) -> None:
    if requested != model:
        raise OpenAIError(f"the model {requested!r} does not exist here; this endpoint serves {model!r}",
                          404, "model", "model_not_found")


def parse_openai(body: bytes, chat: bool, model: str, context: int, default_tokens: int, seed: int) -> OpenAIRequest:
    """A validated request; OpenAIError naming the parameter otherwise. `context`: the model's
    positions, the most `max_tokens` may ask for (less the prompt, checked once it is tokenized);
    `default_tokens`: what a chat request that does not say generates at most. `seed` is used when
    the request gives none (sampling is then still reproducible on a recomputation)."""
    req = validated(ChatCompletionRequest if chat else CompletionRequest, body)
    _check_model(req.model, model)
    limit_name = "max_completion_tokens" if chat and req.max_completion_tokens is not None else "max_tokens"
    max_tokens = getattr(req, limit_name)
    if max_tokens is None:
        max_tokens = min(default_tokens, context) if chat else 16
    if max_tokens > context:
        raise OpenAIError(f"'{limit_name}' must be an integer in 1..{context} (the model's context), got {max_tokens}",
                          param=limit_name)
    temperature = 1.0 if req.temperature is None else req.temperature
    top_p = 1.0 if req.top_p is None else req.top_p
    if chat:
        logprobs, top = bool(req.logprobs), req.top_logprobs or 0
        if top and not logprobs:
            raise OpenAIError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    else:
        logprobs, top = req.logprobs is not None, req.logprobs or 0
    sampling = Sampling(temperature, top_p, seed if req.seed is None else req.seed, top if logprobs else -1)
    ignored = req.ignored + [f"messages[{i}].{k}" for i, m in enumerate(req.messages) for k in m.ignored] \
        if chat else req.ignored
    return OpenAIRequest(
        chat, None if chat else req.prompt,
        [{"role": CHAT_ROLES[m.role], "content": m.text()} for m in req.messages] if chat else None,
        max_tokens, sampling, req.stop or [], bool(req.stream),
        bool(req.stream_options and req.stream_options.include_usage), bool(req.ignore_eos), req.n or 1,
        logprobs, top, ignored)


# -- responses ----------------------------------------------------------------------------------

def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def logprobs_body(req: OpenAIRequest, entries: list[TokenLogprob], decode, offset: int = 0) -> dict | None:
    """A choice's `logprobs` in OpenAI's shape: chat's `content` list, or completions' parallel
    lists (`text_offset` counting from `offset`, the text's start). None when not asked."""
    if not req.logprobs:
        return None
    if req.chat:
        def item(token: int, logprob: float) -> dict:
            text = decode(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
        return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                            for e in entries], "refusal": None}
    texts = [decode(e.token) for e in entries]
    offsets = [offset + sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    return {"tokens": texts, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{decode(t): lp for t, lp in e.top} for e in entries] if req.top_logprobs else None,
            "text_offset": offsets}


def choice_body(req: OpenAIRequest, index: int, text: str, finish: str, logprobs: dict | None) -> dict:
    if req.chat:
        return {"index": index, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                "logprobs": logprobs}
    return {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}


def response_body(req: OpenAIRequest, rid: str, model: str, choices: list[dict], use: dict, timing: dict) -> dict:
    return {"id": rid, "object": "chat.completion" if req.chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": use, "timing": timing}


def chunk(req: OpenAIRequest, rid: str, model: str, text: str | None, finish: str | None,
          first: bool = False, index: int = 0, logprobs: dict | None = None) -> bytes:
    """One server-sent event of a stream: a piece of choice `index`'s text, or (with `finish`)
    its last; the first chat chunk of a choice carries the role."""
    if req.chat:
        delta: dict = {"role": "assistant", "content": text or ""} if first else \
            ({"content": text} if text else {})
        choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
    else:
        choice = {"index": index, "text": text or "", "finish_reason": finish, "logprobs": logprobs}
    body = {"id": rid, "object": "chat.completion.chunk" if req.chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice]}
    if req.include_usage:
        body["usage"] = None
    return sse(body)


def usage_chunk(req: OpenAIRequest, rid: str, model: str, use: dict, timing: dict) -> bytes:
    return sse({"id": rid, "object": "chat.completion.chunk" if req.chat else "text_completion",
                "created": int(time.time()), "model": model, "choices": [], "usage": use, "timing": timing})


def sse(body: dict) -> bytes:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n".encode()


DONE = b"data: [DONE]\n\n"


def model_card(model: str, created: float, context: int) -> dict:
    """One model as `/v1/models` lists it; `max_model_len` (its context, in tokens) as vLLM names it."""
    return {"id": model, "object": "model", "created": int(created), "owned_by": "quart", "max_model_len": context}


def models_body(cards: list[dict]) -> dict:
    return {"object": "list", "data": cards}


# -- embeddings ---------------------------------------------------------------------------------

@dataclass
class EmbeddingsRequest:
    inputs: list[str]
    encoding_format: str


def parse_embeddings(body: bytes, model: str, max_inputs: int) -> EmbeddingsRequest:
    req = validated(EmbeddingRequest, body)
    _check_model(req.model, model)
    inputs = [req.input] if isinstance(req.input, str) else req.input
    if not 1 <= len(inputs) <= max_inputs:
        raise OpenAIError(f"'input' has {len(inputs)} texts; 1 to {max_inputs} are taken", param="input")
    return EmbeddingsRequest(inputs, req.encoding_format or "float")


def embeddings_body(model: str, embeddings, encoding_format: str, tokens: int) -> dict:
    """OpenAI's embeddings list; base64 is the little-endian float32 bytes its client decodes."""
    import base64

    import numpy as np
    rows = embeddings.float().numpy()
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(row.astype("<f4").tobytes()).decode() if encoding_format == "base64"
             else row.tolist()} for i, row in enumerate(np.asarray(rows))]
    return {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
