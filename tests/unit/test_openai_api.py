"""OpenAI request validation and response shapes (what the openai client parses)."""
from __future__ import annotations

import json

import pytest

from frontend import openai_api as oa
from models.sampling import Sampling, TokenLogprob


def parse(data: dict, chat: bool = False) -> oa.OpenAIRequest:
    return oa.parse_openai(json.dumps(data).encode(), chat, "smollm2", 8192, 64, seed=99)


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
    ({"model": "smollm2", "prompt": "hi", "n": 9}, 400, "n"),
    ({"model": "smollm2", "prompt": "hi", "n": 0}, 400, "n"),
    ({"model": "smollm2", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "smollm2", "prompt": "hi", "max_tokens": True}, 400, "max_tokens"),
    ({"model": "smollm2", "prompt": "hi", "temperature": 3}, 400, "temperature"),
    ({"model": "smollm2", "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"model": "smollm2", "prompt": "hi", "seed": -1}, 400, "seed"),
    ({"model": "smollm2", "prompt": "hi", "seed": 2**63}, 400, "seed"),
    ({"model": "smollm2", "prompt": "hi", "stop": ["a"] * 5}, 400, "stop"),
    ({"model": "smollm2", "prompt": "hi", "stream": "yes"}, 400, "stream"),
    ({"model": "smollm2", "prompt": ["a", "b"]}, 400, "prompt"),
    ({"model": "smollm2", "prompt": "hi", "max_tokens": 8193}, 400, "max_tokens"),
    ({"model": "smollm2", "prompt": "hi", "logprobs": 6}, 400, "logprobs"),
    ({"model": "smollm2", "prompt": "hi", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ({"model": "smollm2", "prompt": "hi", "response_format": {"type": "json_object"}}, 400, "response_format"),
])
def test_bad_parameters_name_themselves(data, status, param):
    with pytest.raises(oa.OpenAIError) as err:
        parse(data)
    assert err.value.status == status and err.value.param == param


def test_what_common_clients_send_is_accepted():
    """Neutral values of any falsy kind, the developer and tool roles, empty contents, long
    generations and fields this server does not know (ignored, named for the log)."""
    data = {"model": "smollm2", "logprobs": False, "top_logprobs": 0, "n": 1, "tools": [], "tool_choice": "auto",
            "response_format": {"type": "text"}, "frequency_penalty": 0.0, "presence_penalty": None, "max_tokens": 256,
            "stream_options": None, "metadata": {"a": "b"}, "store": False,
            "messages": [{"role": "developer", "content": "Be brief."}, {"role": "system", "content": ""},
                         {"role": "user", "content": "hi", "name": "me"},
                         {"role": "assistant", "content": None, "tool_calls": []},
                         {"role": "tool", "content": "42", "tool_call_id": "c1"}]}
    req = parse(data, chat=True)
    assert req.max_tokens == 256
    assert [m["role"] for m in req.messages] == ["system", "system", "user", "assistant", "tool"]
    assert [m["content"] for m in req.messages] == ["Be brief.", "", "hi", "", "42"]
    assert req.ignored == ["metadata", "store", "messages[3].tool_calls", "messages[4].tool_call_id"]
    assert parse({"model": "smollm2", "prompt": "hi", "what": 1}).prompt == "hi"


def test_logprobs_and_choices_are_read():
    chat = parse({"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                  "top_logprobs": 3, "n": 2}, chat=True)
    assert (chat.logprobs, chat.top_logprobs, chat.n, chat.sampling.logprobs) == (True, 3, 2, 3)
    done = parse({"model": "smollm2", "prompt": "hi", "logprobs": 0})
    assert (done.logprobs, done.top_logprobs, done.sampling.logprobs) == (True, 0, 0)
    assert parse({"model": "smollm2", "prompt": "hi"}).sampling.logprobs == -1
    with pytest.raises(oa.OpenAIError, match="top_logprobs"):
        parse({"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, chat=True)


def test_logprobs_bodies_have_openai_shapes():
    entries = [TokenLogprob(7, -0.5, [(7, -0.5), (8, -1.5)]), TokenLogprob(9, -0.25, [(9, -0.25), (7, -2.0)])]
    decode = {7: "Hel", 8: "He", 9: "lo"}.__getitem__
    chat = parse({"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                  "top_logprobs": 2}, chat=True)
    body = oa.logprobs_body(chat, entries, decode)
    assert body["content"][1] == {"token": "lo", "logprob": -0.25, "bytes": [108, 111],
                                  "top_logprobs": [{"token": "lo", "logprob": -0.25, "bytes": [108, 111]},
                                                   {"token": "Hel", "logprob": -2.0, "bytes": [72, 101, 108]}]}
    done = oa.logprobs_body(parse({"model": "smollm2", "prompt": "hi", "logprobs": 2}), entries, decode)
    assert done == {"tokens": ["Hel", "lo"], "token_logprobs": [-0.5, -0.25], "text_offset": [0, 3],
                    "top_logprobs": [{"Hel": -0.5, "He": -1.5}, {"lo": -0.25, "Hel": -2.0}]}
    assert oa.logprobs_body(parse({"model": "smollm2", "prompt": "hi"}), entries, decode) is None


def test_embeddings_requests():
    req = oa.parse_embeddings(b'{"model": "m", "input": "a", "encoding_format": "base64"}', "m", 8)
    assert req.inputs == ["a"] and req.encoding_format == "base64"
    for bad in ({"model": "m", "input": []}, {"model": "m", "input": [1, 2]}, {"model": "m", "input": ["a"] * 9},
                {"model": "m", "input": "a", "encoding_format": "int8"}, {"model": "m", "input": "a", "dimensions": 8}):
        with pytest.raises(oa.OpenAIError):
            oa.parse_embeddings(json.dumps(bad).encode(), "m", 8)
    import base64

    import numpy as np
    import torch
    body = oa.embeddings_body("m", torch.tensor([[0.5, -1.0]]), "base64", 3)
    assert np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), "<f4").tolist() == [0.5, -1.0]
    assert oa.embeddings_body("m", torch.tensor([[0.5, -1.0]]), "float", 3)["data"][0]["embedding"] == [0.5, -1.0]


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
