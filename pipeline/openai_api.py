"""The OpenAI-compatible surface of a generative model's entry function: request validation
(`/v1/completions`, `/v1/chat/completions`), response bodies, stream chunks and error bodies in
OpenAI's shapes. Pure: no I/O, no model."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from contracts.wire import BadRequest
from pipeline.entry_requests import ROLES, _is_int
from pipeline.sampling import Sampling

# Parameters OpenAI defines that this server accepts only at their neutral value.
_NEUTRAL = {"n": 1, "best_of": 1, "echo": False, "logprobs": None, "top_logprobs": None, "suffix": None,
            "frequency_penalty": 0, "presence_penalty": 0, "logit_bias": None,
            "response_format": None, "tools": None, "tool_choice": None, "parallel_tool_calls": None}
# "user" is accepted and ignored, as it only labels the caller for OpenAI's own monitoring;
# "ignore_eos" (generate past the end of text, for benchmarks) is vLLM's extension.
_COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "user",
           "ignore_eos"}
COMPLETION_FIELDS = _COMMON | {"prompt"} | set(_NEUTRAL)
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens"} | set(_NEUTRAL)


class OpenAIError(BadRequest):
    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message, status)
        self.param, self.code = param, code


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    kind = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}.get(
        status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


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


def parse_openai(data: dict, chat: bool, model: str, cap: int, seed: int) -> OpenAIRequest:
    """A validated request; OpenAIError naming the parameter otherwise. `seed` is used when the
    request gives none (sampling is then still reproducible on a recomputation)."""
    allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise OpenAIError(f"unrecognized request argument(s): {unknown}", param=unknown[0])
    if data.get("model") != model:
        raise OpenAIError(f"the model {data.get('model')!r} does not exist here; this endpoint serves {model!r}",
                          404, "model", "model_not_found")
    for name, neutral in _NEUTRAL.items():
        if name in data and data[name] not in (neutral, None) and not (name == "logit_bias" and data[name] == {}):
            raise OpenAIError(f"'{name}' is not supported (only {neutral!r})", param=name)
    limit_name = "max_completion_tokens" if chat and "max_completion_tokens" in data else "max_tokens"
    max_tokens = data.get(limit_name, cap if chat else 16)
    if max_tokens is None:
        max_tokens = cap if chat else 16
    if not _is_int(max_tokens) or not 1 <= max_tokens <= cap:
        raise OpenAIError(f"'{limit_name}' must be an integer in 1..{cap}, got {max_tokens!r}", param=limit_name)
    stream = _flag(data, "stream")
    options = data.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise OpenAIError("'stream_options' takes only {\"include_usage\": bool}", param="stream_options")
    request = OpenAIRequest(chat, None, None, max_tokens, _sampling(data, seed), _stop(data.get("stop")), stream,
                            bool(options.get("include_usage", False)), _flag(data, "ignore_eos"))
    if chat:
        request.messages = _messages(data.get("messages"))
    else:
        request.prompt = _prompt(data.get("prompt"))
    return request


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
    if not isinstance(messages, list) or not messages:
        raise OpenAIError("'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or set(m) - {"role", "content", "name"}:
            raise OpenAIError(f"messages[{i}] must be an object with a 'role' in {list(ROLES)} and a 'content'",
                              param=f"messages[{i}]")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text ones
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise OpenAIError(f"messages[{i}].content parts must all be {{\"type\": \"text\", \"text\": ...}}",
                                  param=f"messages[{i}].content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str) or not content.strip():
            raise OpenAIError(f"messages[{i}].content must be a non-empty string", param=f"messages[{i}].content")
        out.append({"role": m["role"], "content": content})
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


def models_body(model: str, created: float) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": int(created), "owned_by": "quart"}]}
