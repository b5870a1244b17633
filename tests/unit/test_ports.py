"""free_port: a port a runtime can put its KeysManagers on, successors included, away from the
ports the kernel hands to client connections and from the blocks handed out before it."""
from __future__ import annotations

import socket
from collections import deque

import pytest

from runtime import ports
from runtime.ports import SUCCESSORS, free_port


@pytest.fixture(autouse=True)
def nothing_handed_out(monkeypatch):
    monkeypatch.setattr(ports, "_recent", deque(maxlen=256))


def test_blocks_bind_and_lie_below_the_ephemeral_range():
    for base in [free_port() for _ in range(20)]:
        assert base + SUCCESSORS < ports._ephemeral_low()
        for port in range(base, base + SUCCESSORS + 1):
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))


def test_blocks_handed_out_in_a_row_do_not_overlap(monkeypatch):
    # 383 bases: ten blocks of 17 drawn at random there would overlap almost surely.
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: 10400)
    ordered = sorted(free_port() for _ in range(10))
    assert all(b - a > SUCCESSORS for a, b in zip(ordered, ordered[1:])), ordered


def test_no_port_is_handed_out_whose_block_holds_a_bound_port(monkeypatch):
    # A range of 40 ports: bases 10000–10022, each with 16 successors. Port 10025 held leaves only
    # the bases whose block ends before it.
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: 10040)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 10025))
        assert free_port() in range(10000, 10009)
        ports._recent.clear()
        with socket.socket() as second:
            second.bind(("127.0.0.1", 10008))
            with pytest.raises(RuntimeError, match="consecutive free ports"):
                free_port()
