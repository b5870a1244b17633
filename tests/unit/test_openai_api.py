"""OpenAI request validation and response shapes (what the openai client parses)."""
from __future__ import annotations

import json

import pytest

from pipeline import openai_api as oa
from pipeline.sampling import Sampling


def parse(data: dict, chat: bool = False) -> oa.OpenAIRequest:
    return oa.parse_openai(data, chat, "smollm2", 64, seed=99)


def test_defaults_follow_openai():
    req = parse({"model": "smollm2", "prompt": "hi"})
    assert req.max_tokens == 16 and req.sampling == Sampling(1.0, 1.0, 99) and not req.stream
    chat = parse({"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]}, chat=True)
    assert chat.max_tokens == 64 and chat.messages == [{"role": "user", "content": "hi"}]


def test_parameters_are_read():
    req = parse({"model": "smollm2", "prompt": ["hi"], "max_tokens": 5, "temperature": 0, "top_p": 0.5, "seed": 3,
                 "stop": "\n", "stream": True, "stream_options": {"include_usage": True}, "n": 1, "user": "u"})
    assert (req.prompt, req.max_tokens, req.stop, req.stream, req.include_usage) == ("hi", 5, ["\n"], True, True)
    assert req.sampling == Sampling(0.0, 0.5, 3)
    chat = parse({"model": "smollm2", "max_completion_tokens": 7,
                  "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]},
                 chat=True)
    assert chat.max_tokens == 7 and chat.messages[0]["content"] == "ab"


@pytest.mark.parametrize("data,status,param", [
    ({"model": "x", "prompt": "hi"}, 404, "model"),
    ({"model": "smollm2", "prompt": "hi", "n": 2}, 400, "n"),
    ({"model": "smollm2", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "smollm2", "prompt": "hi", "max_tokens": True}, 400, "max_tokens"),
    ({"model": "smollm2", "prompt": "hi", "temperature": 3}, 400, "temperature"),
    ({"model": "smollm2", "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"model": "smollm2", "prompt": "hi", "seed": -1}, 400, "seed"),
    ({"model": "smollm2", "prompt": "hi", "stop": ["a"] * 5}, 400, "stop"),
    ({"model": "smollm2", "prompt": "hi", "stream": "yes"}, 400, "stream"),
    ({"model": "smollm2", "prompt": ["a", "b"]}, 400, "prompt"),
    ({"model": "smollm2", "prompt": "hi", "what": 1}, 400, "what"),
])
def test_bad_parameters_name_themselves(data, status, param):
    with pytest.raises(oa.OpenAIError) as err:
        parse(data)
    assert err.value.status == status and err.value.param == param


def test_error_body_has_openai_shape():
    body = oa.error_body("bad", 400, "max_tokens")
    assert body == {"error": {"message": "bad", "type": "invalid_request_error", "param": "max_tokens", "code": None}}
    assert oa.error_body("slow down", 429)["error"]["type"] == "rate_limit_error"


def test_stream_chunks_are_server_sent_events():
    req = parse({"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "stream": True}, chat=True)
    first = oa.chunk(req, "chatcmpl-1", "smollm2", "He", None, first=True)
    assert first.startswith(b"data: ") and first.endswith(b"\n\n")
    body = json.loads(first[6:])
    assert body["object"] == "chat.completion.chunk" and body["choices"][0]["delta"] == {"role": "assistant", "content": "He"}
    last = json.loads(oa.chunk(req, "chatcmpl-1", "smollm2", None, "length")[6:])
    assert last["choices"][0] == {"index": 0, "delta": {}, "finish_reason": "length", "logprobs": None}
    assert oa.DONE == b"data: [DONE]\n\n"
