"""A shard arriving by blocks (keysmanager/blocks.py): each block checked against the manifest's
piece hashes as it is read, written to `<shard>.part` in order by its writer thread whatever order
the blocks come in, served on as far as it is here, and renamed once whole; and the manifest's
piece hashes themselves."""
from __future__ import annotations

import hashlib
import io
import os
import threading
import time

import pytest

from keysmanager.blocks import Corrupt, NotYet, Pull, Reception, Turn, read_checked
from models.manifest import PIECE_BYTES, StageInfo, file_hashes


def shard(tmp_path, size: int) -> tuple[bytes, StageInfo]:
    data = os.urandom(size)
    path = tmp_path / "source.safetensors"
    path.write_bytes(data)
    sha, pieces = file_hashes(path)
    info = StageInfo(index=0, units=(0, 1), layers=(0, 1), has_embed=False, has_head=False, params=0,
                     shard="stage-00.safetensors", sha256=sha, bytes=size, pieces=pieces)
    return data, info


def test_piece_hashes_cover_the_file_in_order(tmp_path):
    data, info = shard(tmp_path, 3 * PIECE_BYTES + 5)
    assert info.sha256 == hashlib.sha256(data).hexdigest()
    assert len(info.pieces) == 4
    assert info.pieces[3] == hashlib.sha256(data[3 * PIECE_BYTES:]).hexdigest()


def test_blocks_arriving_out_of_order_are_written_in_order_and_served_as_far_as_here(tmp_path):
    data, info = shard(tmp_path, 5 * PIECE_BYTES + 17)
    target = tmp_path / "received" / info.shard
    target.parent.mkdir()
    job = Reception("m", info, target, [], [])
    job.part.write_bytes(b"")

    def block(first: int, end: int) -> list[bytes]:
        return read_checked(info, Pull("http://x", first, end), io.BytesIO(data[first * PIECE_BYTES:end * PIECE_BYTES]))

    writer = threading.Thread(target=job.write)
    writer.start()

    def written(pieces: int) -> None:
        with job.lock:
            assert job.changed.wait_for(lambda: job.filled >= pieces, timeout=30)

    job.add(3, block(3, 6))                  # the end first: held, nothing written
    time.sleep(0.2)
    assert job.part.stat().st_size == 0 and job.filled == 0
    assert job.read(4, 6) == data[4 * PIECE_BYTES:]
    with pytest.raises(NotYet):
        job.read(0, 1)
    job.add(0, block(0, 2))                  # the start: written as far as it reaches
    written(2)
    assert job.part.read_bytes() == data[:2 * PIECE_BYTES] and job.filled == 2
    with pytest.raises(NotYet):
        job.read(1, 4)
    job.add(2, block(2, 3))                  # the gap: everything written, renamed
    writer.join(timeout=30)
    assert job.finished and not job.part.exists() and target.read_bytes() == data and not job.held
    assert job.read(1, 4) == data[PIECE_BYTES:4 * PIECE_BYTES]


def test_a_block_that_is_not_its_pieces_is_refused(tmp_path):
    data, info = shard(tmp_path, 4 * PIECE_BYTES)
    good = data[PIECE_BYTES:3 * PIECE_BYTES]

    def read(body: bytes) -> list[bytes]:
        return read_checked(info, Pull("http://x", 1, 3), io.BytesIO(body))

    assert b"".join(read(good)) == good
    flipped = bytearray(good)
    flipped[PIECE_BYTES + 3] ^= 1
    with pytest.raises(Corrupt, match="piece 2"):
        read(bytes(flipped))
    with pytest.raises(Corrupt, match="for piece 2"):
        read(good[:-1])
    with pytest.raises(Corrupt, match="more bytes"):
        read(good + b"x")


def test_a_pull_is_its_json_and_its_place_in_the_plan_its_query():
    plain = Pull("http://127.0.0.1:9000", 0, 4)
    placed = Pull("http://127.0.0.1:9000", 4, 8, Turn("ab12", 3, 1))
    for pull in (plain, placed):
        assert Pull.from_json(pull.to_json()) == pull
    assert Turn.parse({"plan": "ab12", "round": "3", "after": "1"}) == placed.turn  # as the block route's query
    assert Turn.parse({}) is None
    for bad in ({"plan": "xyz", "round": 1}, {"plan": "ab", "round": "one"}, {"plan": "ab", "round": 2, "after": 2},
                {"plan": "ab", "round": True}, {"plan": "ab"}):
        with pytest.raises(ValueError):
            Turn.parse(bad)
    with pytest.raises(ValueError, match="source"):
        Pull.from_json({"source": "file:///etc/passwd", "first": 0, "end": 1})
