"""The wire format: safetensors bytes with a JSON header, never pickle."""
from __future__ import annotations

import pickle

import pytest
import torch

from contracts.wire import HEADER_KEY, BadRequest, Header, StageTiming, decode_tensors, encode_tensors, pack, unpack


def test_round_trip_keeps_header_and_tensors():
    header = Header(request_id="r1.0", model="smollm2", stage=2, reply_to="quart:reply:x", deadline=1e10,
                    timings=[StageTiming(0, "a", 1.5, 2.5)])
    tensors = {"hidden": torch.randn(1, 7, 576), "attention_mask": torch.ones(1, 7, dtype=torch.long),
               "half": torch.randn(2, 3).to(torch.bfloat16)}
    got_header, got = unpack(pack(header, tensors))
    assert got_header == header
    assert set(got) == set(tensors)
    for k in tensors:
        assert got[k].dtype == tensors[k].dtype and torch.equal(got[k], tensors[k])


@pytest.mark.parametrize("raw", [b"", b"not safetensors at all", b"\xff" * 16,
                                 pickle.dumps({"x": torch.ones(2)})])
def test_malformed_bytes_are_bad_requests(raw):
    with pytest.raises(BadRequest):
        decode_tensors(raw)
    with pytest.raises(BadRequest):
        unpack(raw)


def test_tensors_without_header_cannot_pass_as_a_message():
    with pytest.raises(BadRequest, match="no header"):
        unpack(encode_tensors({"x": torch.ones(1)}))
    with pytest.raises(BadRequest, match="malformed"):
        unpack(encode_tensors({"x": torch.ones(1)}, metadata={HEADER_KEY: '{"nonsense": 1}'}))
