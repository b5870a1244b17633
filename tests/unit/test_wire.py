"""The wire format: safetensors bytes with a JSON header, never pickle."""
from __future__ import annotations

import json
import pickle

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from contracts.wire import DTYPES, HEADER_KEY, BadRequest, Header, StageTiming, decode_tensors, encode_tensors, pack, unpack

HEADER = Header(request_id="r1.0", model="smollm2", stage=2, reply_to="quart:reply:x", deadline=1e10,
                route={"0": "smollm2-s0-a"}, sampling={"temperature": 0.0, "seed": 3})


def _every_dtype() -> dict[str, torch.Tensor]:
    tensors = {str(dtype): torch.randn(2, 3).mul(4).to(dtype) for dtype in DTYPES}
    return {**tensors, "scalar": torch.tensor(2.5), "empty": torch.empty(0, 4), "strided": torch.randn(4, 6)[:, ::2]}


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


def test_messages_are_safetensors_both_ways():
    """`pack` frames a message itself (contracts/wire.py says why): the library must read it, and
    `unpack` must read what the library writes, for every dtype a message carries."""
    tensors = _every_dtype()
    ours = st_load(pack(HEADER, tensors))
    header, theirs = unpack(st_save({k: v.contiguous() for k, v in tensors.items()},
                                    metadata={HEADER_KEY: HEADER.to_json().decode()}))
    assert header == HEADER
    for got in (ours, theirs):
        assert set(got) == set(tensors)
        for k, v in tensors.items():
            assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k].float(), v.float()), k


def test_bytes_off_their_alignment_are_read_too():
    index = {"flag": {"dtype": "BOOL", "shape": [3], "data_offsets": [0, 3]},
             "n": {"dtype": "I64", "shape": [2], "data_offsets": [3, 19]}}
    _, got = unpack(_framed(index, bytes([1, 0, 1]) + torch.tensor([7, -9]).numpy().tobytes()))
    assert got["flag"].tolist() == [True, False, True] and got["n"].tolist() == [7, -9]


def test_unpacked_tensors_own_their_memory():
    raw = pack(HEADER, {"hidden": torch.zeros(1, 4)})
    _, got = unpack(raw)
    got["hidden"] += 1
    assert torch.equal(unpack(raw)[1]["hidden"], torch.zeros(1, 4))


def _framed(index: dict, data: bytes) -> bytes:
    head = json.dumps({"__metadata__": {HEADER_KEY: HEADER.to_json().decode()}, **index}).encode()
    return len(head).to_bytes(8, "little") + head + data


@pytest.mark.parametrize("index, data, why", [
    ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, "does not fit"),
    ({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, "does not fit"),
    ({"x": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8, "does not fit"),
    ({"x": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8, "does not fit"),
    ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "y": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8, "does not fit"),
    ({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 8, "left over"),
    ({"x": {"dtype": "PICKLE", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, "no known dtype"),
    ({"x": {"dtype": "F32", "shape": "1", "data_offsets": [0, 4]}}, b"\0" * 4, "no known dtype"),
    ({"x": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, b"\0" * 4, "no valid data offsets"),
    ({"x": {"dtype": "F32", "shape": [1]}}, b"\0" * 4, "no valid data offsets"),
    ({"x": [1, 2]}, b"", "no valid data offsets"),
])
def test_an_index_that_does_not_match_its_bytes_is_a_bad_request(index, data, why):
    with pytest.raises(BadRequest, match=why):
        unpack(_framed(index, data))


def test_a_header_longer_than_the_message_is_a_bad_request():
    raw = pack(HEADER, {"x": torch.ones(2)})
    with pytest.raises(BadRequest, match="shorter"):
        unpack(raw[:40])
