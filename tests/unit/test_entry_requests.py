"""Validation of user requests, case by case."""
from __future__ import annotations

import pytest

from contracts.wire import BadRequest
from frontend.entry_requests import check_prompt_length, parse_embed, parse_generate, parse_json

BAD_GENERATE = [
    ({}, "exactly one"),
    ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "exactly one"),
    ({"prompt": 3}, "must be a string"),
    ({"prompt": "   "}, "empty"),
    ({"prompt": "a", "max_new_tokens": 0}, "max_new_tokens"),
    ({"prompt": "a", "max_new_tokens": 1000}, "max_new_tokens"),
    ({"prompt": "a", "max_new_tokens": "3"}, "max_new_tokens"),
    ({"prompt": "a", "max_new_tokens": True}, "max_new_tokens"),
    ({"prompt": "a", "temperature": 0.5}, "unknown field"),
    ({"messages": []}, "non-empty list"),
    ({"messages": "hi"}, "non-empty list"),
    ({"messages": [{"role": "user"}]}, "exactly 'role' and 'content'"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "role must be one of"),
    ({"messages": [{"role": "user", "content": 5}]}, "content must be a non-empty string"),
]


@pytest.mark.parametrize("data,message", BAD_GENERATE)
def test_bad_generate_requests(data, message):
    with pytest.raises(BadRequest, match=message) as info:
        parse_generate(data, cap=64)
    assert 400 <= info.value.status < 500


def test_good_generate_requests():
    assert parse_generate({"prompt": "hi"}, 64).max_new_tokens == 1
    req = parse_generate({"messages": [{"role": "user", "content": "hi"}], "max_new_tokens": 5}, 64)
    assert req.messages == [{"role": "user", "content": "hi"}] and req.max_new_tokens == 5


@pytest.mark.parametrize("body", [b"{", b"[1, 2]", b"\xff\xfe", b"null", b'"text"', b"[" * 100_000 + b"]" * 100_000,
                                  b'{"max_new_tokens": ' + b"9" * 5000 + b"}", b'{"prompt": "\\ud800"}'])
def test_bodies_that_are_not_json_objects(body):
    with pytest.raises(BadRequest):
        parse_json(body)


@pytest.mark.parametrize("data,status", [({"inputs": []}, 400), ({"inputs": "x"}, 400), ({"inputs": [""]}, 400),
                                         ({"inputs": [1]}, 400), ({"inputs": ["a"] * 65}, 413), ({}, 400),
                                         ({"inputs": ["a"], "extra": 1}, 400)])
def test_bad_embed_requests(data, status):
    with pytest.raises(BadRequest) as info:
        parse_embed(data, max_inputs=64)
    assert info.value.status == status


def test_prompt_length_limits():
    check_prompt_length(100, 10, 2048, 8192)
    with pytest.raises(BadRequest, match="at most 2048") as info:
        check_prompt_length(3000, 1, 2048, 8192)
    assert info.value.status == 413
    with pytest.raises(BadRequest, match="positions"):
        check_prompt_length(2000, 100, 4096, 2048)
