"""A replica following a shard as it arrives (models/shard_reader._follow), and a KeysManager
waiting to keep a received shard (`KeysManager._arrived`), wait while the model's other shards
arrive ahead of it, as a multicast sends them in its plan's order, and give up only once nothing
in the model's prefetch folder moves for the stall time."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from contracts.config import load_settings
from keysmanager.manager import KeysManager
from models.fetch import FetchError
from models.shard_reader import PART, _follow

# Long enough that a loaded host's scheduling (the writer thread not run for a while) is not a
# stall; the first test sends for four of them.
STALL_S = 1.0
SIZE = 1 << 16


def _grow(part: Path, seconds: float, then: Path | None = None) -> None:
    """Appends to `part` for `seconds`, then renames it to `then` (None: leaves it)."""
    end = time.monotonic() + seconds
    with open(part, "ab") as out:
        while time.monotonic() < end:
            out.write(b"x" * 64)
            out.flush()
            time.sleep(STALL_S / 20)
    if then is not None:
        part.rename(then)


def _shard_after(earlier: Path, mine: Path, seconds: float) -> None:
    """The multicast's order: `earlier` arrives for `seconds` (several stall times), and only
    then does `mine`, whole."""
    _grow(earlier.with_name(earlier.name + PART), seconds, earlier)
    part = mine.with_name(mine.name + PART)
    part.write_bytes(bytes(range(256)) * (SIZE // 256))
    part.rename(mine)


def test_a_shard_waits_while_the_shards_before_it_arrive(tmp_path):
    mine, earlier = tmp_path / "stage-1.safetensors", tmp_path / "stage-0.safetensors"
    mine.with_name(mine.name + PART).write_bytes(b"")  # the reception opens every .part at its start
    sender = threading.Thread(target=_shard_after, args=(earlier, mine, 4 * STALL_S))
    sender.start()
    view = memoryview(bytearray(SIZE))
    try:
        assert sum(_follow(mine, view, STALL_S)) == SIZE
    finally:
        sender.join()
    assert bytes(view) == mine.read_bytes()


def test_a_model_whose_arrival_stops_fails_after_the_stall_time(tmp_path):
    mine, earlier = tmp_path / "stage-1.safetensors", tmp_path / "stage-0.safetensors"
    mine.with_name(mine.name + PART).write_bytes(b"")
    _grow(earlier.with_name(earlier.name + PART), STALL_S / 2)  # then stops: the sender died
    started = time.monotonic()
    with pytest.raises(FetchError, match="made no progress"):
        list(_follow(mine, memoryview(bytearray(SIZE)), STALL_S))
    assert time.monotonic() - started < 5 * STALL_S


def _keys_manager(tmp_path: Path) -> KeysManager:
    settings = load_settings(environ={"QUART_HOME": str(tmp_path / "home"), "QUART_FETCH_STALL_S": str(STALL_S)})
    return KeysManager(settings, store=None)  # waiting for a shard reads no records


def test_the_keys_manager_waits_for_a_received_shard_while_the_shards_before_it_arrive(tmp_path):
    mine, earlier = tmp_path / "stage-1.safetensors", tmp_path / "stage-0.safetensors"
    mine.with_name(mine.name + PART).write_bytes(b"")
    sender = threading.Thread(target=_shard_after, args=(earlier, mine, 4 * STALL_S))
    sender.start()
    try:
        assert _keys_manager(tmp_path)._arrived(mine)
    finally:
        sender.join()


def test_the_keys_manager_gives_up_on_a_shard_whose_model_stops_arriving(tmp_path):
    mine, earlier = tmp_path / "stage-1.safetensors", tmp_path / "stage-0.safetensors"
    mine.with_name(mine.name + PART).write_bytes(b"")
    _grow(earlier.with_name(earlier.name + PART), STALL_S / 2)
    started = time.monotonic()
    assert not _keys_manager(tmp_path)._arrived(mine)
    assert time.monotonic() - started < 5 * STALL_S
