"""The OpenAI-compatible surface of a generative model's entry function: request validation
(`/v1/completions`, `/v1/chat/completions`), response bodies, stream chunks and error bodies in
OpenAI's shapes. Pure: no I/O, no model."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from contracts.openai_errors import error_body  # noqa: F401 (the entry's error answers)
from contracts.wire import BadRequest
from pipeline.entry_requests import _is_int
from pipeline.sampling import Sampling

# Parameters OpenAI defines that this server accepts only at their neutral value; any falsy value
# (None, False, 0, "", {}, []) is neutral, as clients and frameworks send whichever they like.
_NEUTRAL = {"n": 1, "best_of": 1, "echo": False, "logprobs": None, "top_logprobs": None, "suffix": None,
            "frequency_penalty": 0, "presence_penalty": 0, "logit_bias": None, "tools": None,
            "parallel_tool_calls": None, "functions": None}
# Parameters that change nothing here at these values.
_HARMLESS = {"response_format": ({"type": "text"},), "tool_choice": ("none", "auto"), "function_call": ("none", "auto")}
# "user" (and the like) only label the caller; "ignore_eos" (generate past the end of text, for
# benchmarks) is vLLM's extension.
_COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "ignore_eos"}
COMPLETION_FIELDS = _COMMON | {"prompt"} | set(_NEUTRAL) | set(_HARMLESS)
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens"} | set(_NEUTRAL) | set(_HARMLESS)
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


def parse_openai(data: dict, chat: bool, model: str, context: int, default_tokens: int, seed: int) -> OpenAIRequest:
    """A validated request; OpenAIError naming the parameter otherwise. `context`: the model's
    positions, the most `max_tokens` may ask for (less the prompt, checked once it is tokenized);
    `default_tokens`: what a chat request that does not say generates at most. `seed` is used when
    the request gives none (sampling is then still reproducible on a recomputation). Fields this
    server does not know are ignored (`ignored_fields` names them, for the log), as vLLM does."""
    if data.get("model") != model:
        raise OpenAIError(f"the model {data.get('model')!r} does not exist here; this endpoint serves {model!r}",
                          404, "model", "model_not_found")
    for name, neutral in _NEUTRAL.items():
        if data.get(name) and data[name] != neutral:
            raise OpenAIError(f"'{name}' is not supported (only {neutral!r})", param=name)
    for name, allowed in _HARMLESS.items():
        if data.get(name) and data[name] not in allowed:
            raise OpenAIError(f"'{name}' is not supported (only {' or '.join(map(repr, allowed))})", param=name)
    limit_name = "max_completion_tokens" if chat and data.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = data.get(limit_name)
    if max_tokens is None:
        max_tokens = min(default_tokens, context) if chat else 16
    if not _is_int(max_tokens) or not 1 <= max_tokens <= context:
        raise OpenAIError(f"'{limit_name}' must be an integer in 1..{context}, got {max_tokens!r}", param=limit_name)
    stream = _flag(data, "stream")
    options = data.get("stream_options") or {}
    if not isinstance(options, dict):
        raise OpenAIError("'stream_options' must be an object", param="stream_options")
    request = OpenAIRequest(chat, None, None, max_tokens, _sampling(data, seed), _stop(data.get("stop")), stream,
                            bool(options.get("include_usage")), _flag(data, "ignore_eos"))
    if chat:
        request.messages = _messages(data.get("messages"))
    else:
        request.prompt = _prompt(data.get("prompt"))
    return request


def ignored_fields(data: dict, chat: bool) -> list[str]:
    return sorted(set(data) - (CHAT_FIELDS if chat else COMPLETION_FIELDS))


def _flag(data: dict, name: str) -> bool:
    value = data.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise OpenAIError(f"'{name}' must be a boolean", param=name)
    return value


def _number(data: dict, name: str, default: float, low: float, high: float) -> float:
    value = data.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise OpenAIError(f"'{name}' must be a number in [{low:g}, {high:g}], got {value!r}", param=name)
    return float(value)


def _sampling(data: dict, seed: int) -> Sampling:
    temperature = _number(data, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(data, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise OpenAIError("'top_p' must be greater than 0", param="top_p")
    given = data.get("seed")
    if given is not None and (not _is_int(given) or given < 0):
        raise OpenAIError("'seed' must be a non-negative integer", param="seed")
    return Sampling(temperature, top_p, seed if given is None else given)


def _stop(stop: object) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise OpenAIError("'stop' must be a non-empty string or a list of at most 4 of them", param="stop")
    return stops


def _prompt(prompt: object) -> str:
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise OpenAIError("'prompt' must be a string (or a list of exactly one)", param="prompt")
    if not prompt.strip():
        raise OpenAIError("'prompt' is empty", param="prompt")
    return prompt


def _messages(messages: object) -> list[dict[str, str]]:
    """Each message's role (mapped for the chat template) and its text; other fields (`name`,
    `tool_calls`, `tool_call_id`) are not the template's business here. Empty contents are kept:
    an empty system prompt, an assistant turn that only called a tool."""
    if not isinstance(messages, list) or not messages:
        raise OpenAIError("'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
            raise OpenAIError(f"messages[{i}] must be an object with a 'role' in {list(CHAT_ROLES)}",
                              param=f"messages[{i}]")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text ones
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise OpenAIError(f"messages[{i}].content parts must all be {{\"type\": \"text\", \"text\": ...}}",
                                  param=f"messages[{i}].content")
            content = "".join(p["text"] for p in content)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise OpenAIError(f"messages[{i}].content must be a string or a list of text parts",
                              param=f"messages[{i}].content")
        out.append({"role": CHAT_ROLES[m["role"]], "content": content})
    return out


# -- responses ----------------------------------------------------------------------------------

def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response_body(req: OpenAIRequest, rid: str, model: str, text: str, finish: str, use: dict, timing: dict) -> dict:
    if req.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                  "logprobs": None}
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    return {"id": rid, "object": "chat.completion" if req.chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": use, "timing": timing}


def chunk(req: OpenAIRequest, rid: str, model: str, text: str | None, finish: str | None,
          first: bool = False) -> bytes:
    """One server-sent event of a stream: a piece of text, or (with `finish`) the last choice; the
    first chat chunk carries the role."""
    if req.chat:
        delta: dict = {"role": "assistant", "content": text or ""} if first else \
            ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
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


def parse_embeddings(data: dict, model: str, max_inputs: int) -> EmbeddingsRequest:
    """`input` a string or a list of strings; `encoding_format` float or base64 (OpenAI's client
    asks for base64 unless told otherwise); `dimensions` only at the model's own."""
    if data.get("model") != model:
        raise OpenAIError(f"the model {data.get('model')!r} does not exist here; this endpoint serves {model!r}",
                          404, "model", "model_not_found")
    raw = data.get("input")
    inputs = [raw] if isinstance(raw, str) else raw
    if not isinstance(inputs, list) or not inputs or not all(isinstance(t, str) for t in inputs):
        raise OpenAIError("'input' must be a string or a non-empty list of strings (token arrays are not taken)",
                          param="input")
    if len(inputs) > max_inputs:
        raise OpenAIError(f"'input' has {len(inputs)} texts; at most {max_inputs}", param="input")
    fmt = data.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise OpenAIError("'encoding_format' must be float or base64", param="encoding_format")
    if data.get("dimensions"):
        raise OpenAIError("'dimensions' is not supported: the model's embeddings have their own width",
                          param="dimensions")
    return EmbeddingsRequest(inputs, fmt)


def embeddings_body(model: str, embeddings, encoding_format: str, tokens: int) -> dict:
    """OpenAI's embeddings list; base64 is the little-endian float32 bytes its client decodes."""
    import base64

    import numpy as np
    rows = embeddings.float().numpy()
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(row.astype("<f4").tobytes()).decode() if encoding_format == "base64"
             else row.tolist()} for i, row in enumerate(np.asarray(rows))]
    return {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
