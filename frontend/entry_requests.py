"""Validation of user requests to a model's entry function. Every problem is a BadRequest naming it."""
from __future__ import annotations

from dataclasses import dataclass

from contracts.requests import BadRequest, load_json

ROLES = ("system", "user", "assistant")
# sentence-transformers' max_seq_length for all-MiniLM-L6-v2: longer inputs are truncated.
EMBED_MAX_TOKENS = 256


@dataclass
class GenerateRequest:
    prompt: str | None
    messages: list[dict[str, str]] | None
    max_new_tokens: int
    ignore_eos: bool = False


def parse_json(body: bytes) -> dict:
    data = load_json(body)
    if not isinstance(data, dict):
        raise BadRequest(f"the body must be a JSON object, not {type(data).__name__}")
    return data


def _reject_unknown(data: dict, allowed: set[str]) -> None:
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise BadRequest(f"unknown field(s) {unknown}; allowed: {sorted(allowed)}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_generate(data: dict, cap: int) -> GenerateRequest:
    _reject_unknown(data, {"prompt", "messages", "max_new_tokens", "ignore_eos"})
    if ("prompt" in data) == ("messages" in data):
        raise BadRequest("give exactly one of 'prompt' (a string) or 'messages' (a list)")
    max_new = data.get("max_new_tokens", 1)
    if not _is_int(max_new) or not 1 <= max_new <= cap:
        raise BadRequest(f"'max_new_tokens' must be an integer in 1..{cap}, got {max_new!r}")
    ignore_eos = data.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise BadRequest("'ignore_eos' must be true or false")
    if "prompt" in data:
        prompt = data["prompt"]
        if not isinstance(prompt, str):
            raise BadRequest(f"'prompt' must be a string, not {type(prompt).__name__}")
        if not prompt.strip():
            raise BadRequest("'prompt' is empty")
        return GenerateRequest(prompt, None, max_new, ignore_eos)
    return GenerateRequest(None, _parse_messages(data["messages"]), max_new, ignore_eos)


def _parse_messages(messages: object) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of {\"role\", \"content\"} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            raise BadRequest(f"messages[{i}] must be an object with exactly 'role' and 'content'")
        if m["role"] not in ROLES:
            raise BadRequest(f"messages[{i}].role must be one of {list(ROLES)}, got {m['role']!r}")
        if not isinstance(m["content"], str) or not m["content"].strip():
            raise BadRequest(f"messages[{i}].content must be a non-empty string")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def parse_embed(data: dict, max_inputs: int) -> list[str]:
    _reject_unknown(data, {"inputs"})
    inputs = data.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise BadRequest("'inputs' must be a non-empty list of strings")
    if len(inputs) > max_inputs:
        raise BadRequest(f"{len(inputs)} inputs; at most {max_inputs} per request", status=413)
    for i, text in enumerate(inputs):
        if not isinstance(text, str) or not text.strip():
            raise BadRequest(f"inputs[{i}] must be a non-empty string")
    return inputs


def check_prompt_length(num_tokens: int, max_new: int, max_prompt: int, max_positions: int) -> None:
    if num_tokens > max_prompt:
        raise BadRequest(f"prompt has {num_tokens} tokens; at most {max_prompt}", status=413)
    if num_tokens + max_new > max_positions:
        raise BadRequest(f"prompt of {num_tokens} tokens plus {max_new} new ones exceeds the "
                         f"model's {max_positions} positions", status=413)

def check_prompt_chars(chars: int, max_prompt: int, chars_per_token: int) -> None:
    """Before tokenizing: no token covers more than `chars_per_token` characters, so a longer text
    has more tokens than allowed whatever they are (and tokenizing megabytes takes minutes)."""
    if chars > max_prompt * chars_per_token:
        raise BadRequest(f"prompt of {chars} characters is over {max_prompt} tokens long; "
                         f"at most {max_prompt} tokens", status=413)


def parse_emulated(data: dict, max_tokens: int) -> int:
    """An emulated model takes {"tokens": n} (default 16): the size of the activation it passes on."""
    _reject_unknown(data, {"tokens"})
    tokens = data.get("tokens", 16)
    if not _is_int(tokens) or not 1 <= tokens <= max_tokens:
        raise BadRequest(f"'tokens' must be an integer in 1..{max_tokens}, got {tokens!r}")
    return tokens
