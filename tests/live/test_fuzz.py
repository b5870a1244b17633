"""Malformed input, generated: every public endpoint of the runtime (a generative model's native
and OpenAI paths, an embedding model, the gateway's one OpenAI base URL, the gateway's admin API with its credentials, a stage's
direct invoke with the internal token, the KeysManager's API with it) gets hundreds of bodies made
by breaking valid ones, seeded. None may get a 5xx; every error is a JSON object with "error"."""
from __future__ import annotations

import json
import random
from collections.abc import Iterator

import pytest
import torch

from contracts.http_client import HttpClient
from contracts.secrets import bearer
from contracts.wire import encode_tensors
from keysmanager.client import KeysClient

SEED = 20261123

# Values that are wrong in most places a field can be, as JSON text (some no JSON parser keeps).
BAD_VALUES = [
    "null", "true", "false", "-1", "0", "1.5", "1e309", "-1e309", "NaN", "Infinity", "10" * 40, "9" * 5000,
    '""', '" "', '"\\ud800"', '"\\u0000"', '"x"', '"🙂"', "[]", "{}", "[null]", "[1, 2]", '{"a": 1}',
    "[" * 3000 + "]" * 3000, '"' + "word " * 5000 + '"', "[" + ", ".join(['"a"'] * 200) + "]",
]

# Whole bodies that are not what any endpoint takes.
BAD_BODIES = [
    b"", b" ", b"null", b"0", b"[]", b'"text"', b"{", b"}", b"{}", b'{"a":', b"{'single': 'quotes'}",
    b"\xff\xfe\x00garbage", b"\xef\xbb\xbf{}", b"[" * 100000, b'{"a": ' * 50000, b"1" * 10000,
    b'{"prompt": "\\ud800"}', b'{"prompt": NaN}', b"\x1f\x8b\x08\x00broken gzip",
]


def _dumps(obj: dict, replace: dict[str, str]) -> bytes:
    """`obj` as JSON with some values swapped for raw JSON text."""
    marked = {k: f"@@{k}@@" if k in replace else v for k, v in obj.items()}
    text = json.dumps(marked)
    for key, raw in replace.items():
        text = text.replace(json.dumps(f"@@{key}@@"), raw)
    return text.encode()


def broken(valid: dict, rng: random.Random, extra: int) -> Iterator[bytes]:
    """Each field given each bad value; each field left out; unknown fields; the valid body cut
    short at random places; `extra` random combinations of two bad fields."""
    for key in valid:
        for raw in BAD_VALUES:
            yield _dumps(valid, {key: raw})
        yield json.dumps({k: v for k, v in valid.items() if k != key}).encode()
    yield json.dumps({**valid, "unexpected": 1}).encode()
    text = json.dumps(valid).encode()
    for _ in range(5):
        yield text[:rng.randrange(1, len(text))]
    keys = list(valid)
    for _ in range(extra):
        chosen = rng.sample(keys, min(2, len(keys)))
        yield _dumps(valid, {k: rng.choice(BAD_VALUES) for k in chosen})
    yield from BAD_BODIES


def check(reply, where: str) -> None:
    assert reply.status < 500, (where, reply.status, reply.body[:300])
    if reply.status >= 400:
        try:
            body = json.loads(reply.body)
        except ValueError:
            raise AssertionError((where, reply.status, "not JSON", reply.body[:300])) from None
        assert isinstance(body, dict) and "error" in body, (where, reply.status, body)


def _scales(body: bytes) -> bool:
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return False
    return isinstance(data, dict) and type(data.get("replicas")) is int


def _cases(runtime) -> Iterator[tuple[str, str, str, dict, bytes]]:
    """(label, method, path, headers, body)."""
    rng = random.Random(SEED)
    public = [
        ("/function/smollm2", {"prompt": "Hi", "max_new_tokens": 1, "ignore_eos": False}),
        ("/function/smollm2", {"messages": [{"role": "user", "content": "Hi"}], "max_new_tokens": 1}),
        ("/function/smollm2/v1/completions", {"model": "smollm2", "prompt": "Hi", "max_tokens": 1,
                                              "temperature": 0.5, "top_p": 0.9, "seed": 1, "stop": ["\n"]}),
        ("/function/smollm2/v1/chat/completions", {"model": "smollm2", "max_tokens": 1, "stream": False,
                                                   "messages": [{"role": "user", "content": "Hi"}]}),
        ("/function/minilm", {"inputs": ["one sentence", "another"]}),
        # The gateway's one OpenAI base URL, routing on the body's model.
        ("/v1/chat/completions", {"model": "smollm2", "max_tokens": 1, "logprobs": False, "n": 1,
                                  "messages": [{"role": "developer", "content": ""}, {"role": "user", "content": "Hi"}]}),
        ("/v1/embeddings", {"model": "minilm", "input": ["one sentence", "another"], "encoding_format": "base64"}),
    ]
    for path, valid in public:
        for body in broken(valid, rng, extra=4):
            yield "public", "POST", path, {"Content-Type": "application/json"}, body
    # An image the runtime does not know: however a field breaks, nothing is deployed.
    for body in broken({"service": "fuzzed", "image": "unknown/image:1", "envVars": {"QUART_MODEL": "x"}},
                       rng, extra=2):
        yield "admin", "POST", "/system/functions", {}, body
    for body in broken({"serviceName": "minilm-s2", "replicas": 1}, rng, extra=2):
        if not _scales(body):  # only bodies that must be refused: the runtime keeps its replicas
            yield "admin", "POST", "/system/scale-function/minilm-s2", {}, body
    for method in ("GET", "PUT", "DELETE", "PATCH"):
        yield "public", method, "/function/smollm2/v1/completions", {}, b"{}"
        yield "public", method, "/v1/chat/completions", {}, b"{}"
        yield "public", method, "/v1/no-such-route", {}, b"{}"
        yield "public", method, "/system/no-such-route", {}, b""
    for tensors in ({"hidden": torch.zeros(1, 2, 3)}, {"hidden": torch.zeros(0, 2, 576)},
                    {"input_ids": torch.tensor([[-5]])}, {"hidden": torch.zeros(1, 0, 576)}):
        yield "internal", "POST", "/function/smollm2-s1", bearer(runtime.internal_api_token()), encode_tensors(tensors)


def test_no_malformed_request_gets_a_5xx_or_a_non_json_error(runtime, client):
    anonymous = HttpClient(runtime.gateway.url, timeout=60)
    cases = list(_cases(runtime))
    assert len(cases) >= 300
    for label, method, path, headers, body in cases:
        user = client if label == "admin" else anonymous
        check(user.request(method, path, body, headers=headers), f"{method} {path} {body[:80]!r}")


@pytest.mark.parametrize("path", ["/cache", "/fork", "/evict", "/prefetch"])
def test_no_malformed_keysmanager_request_gets_a_5xx(runtime, path):
    keys = KeysClient.for_settings(runtime, timeout=60)
    rng = random.Random(SEED)
    # A model that is not here, so that a body that happens to be valid changes nothing.
    for body in broken({"model": "no-such-model", "stages": "1", "function": "no-such-model-s1", "cow": True,
                        "env": {"QUART_MAX_BATCH": "1"}}, rng, extra=10):
        check(keys.request("POST", path, body, headers={"Content-Type": "application/json"}), f"{path} {body[:80]!r}")
    check(keys.request("PUT", "/config", b'{"memory_threshold": NaN}'), "/config NaN")
    for model in ("NoSuch", "..", "a%2F..%2Fb", "x" * 300):
        check(keys.request("DELETE", f"/prefetch/{model}"), f"DELETE /prefetch/{model}")


def test_valid_bodies_up_to_the_documented_caps_are_accepted(runtime, client, tokenizer):
    # A body just under QUART_MAX_BODY_BYTES (the entry embeds the first tokens of each input),
    # and the most inputs an embedding request may have.
    limit = runtime.limits.max_body_bytes
    body = json.dumps({"inputs": ["x " * ((limit - 1000) // 8)] * 4}).encode()
    assert limit - 2000 < len(body) <= limit
    reply = client.invoke("minilm", body)
    assert reply.status == 200, reply.body[:300]
    assert len(reply.json()["embeddings"]) == 4
    reply = client.invoke("minilm", {"inputs": ["a short one"] * runtime.limits.max_inputs})
    assert reply.status == 200, reply.body[:300]
    assert len(reply.json()["embeddings"]) == runtime.limits.max_inputs
    # A prompt of exactly QUART_MAX_PROMPT_TOKENS tokens.
    ids = tokenizer(" hello" * 2000)["input_ids"][:runtime.limits.max_prompt_tokens]
    prompt = tokenizer.decode(ids)
    assert len(tokenizer(prompt)["input_ids"]) == runtime.limits.max_prompt_tokens
    reply = client.invoke("smollm2", {"prompt": prompt, "max_new_tokens": 1})
    assert reply.status == 200, reply.body[:300]
