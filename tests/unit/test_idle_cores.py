"""The core board between real processes: a step alone takes every core, its own share while
others compute and for a while after steps overlapped, and a dead replica's slot and mark stop
counting."""
from __future__ import annotations

import multiprocessing
import os
import signal

from engine import idle_cores
from engine.idle_cores import CoreBoard, usable_cores

FORK = multiprocessing.get_context("fork")


def _computes(path, marked, release, ended) -> None:
    """A replica of another process: marks a step, ends it when released, then stays alive."""
    board = CoreBoard(path, cores=4)
    board.begin(1)
    marked.set()
    release.wait(30)
    board.end()
    ended.set()
    signal.pause()


def _other(path):
    events = [FORK.Event() for _ in range(3)]
    child = FORK.Process(target=_computes, args=(path, *events), daemon=True)
    child.start()
    assert events[0].wait(30), "the other process did not start its step"
    return child, events


def test_a_step_alone_takes_every_core_and_none_after_steps_overlapped(tmp_path, monkeypatch):
    path = tmp_path / "cores"
    board = CoreBoard(path, cores=4)
    assert board.begin(1) == 4   # alone, and no overlap yet: every core
    board.end()
    child, (_, release, ended) = _other(path)
    try:
        assert board.begin(1) == 1          # another replica computing: its own share
        assert board.begin(2) == 2          # never fewer than its own share
        board.end()
        release.set()
        assert ended.wait(30)
        assert board.begin(1) == 1          # alone again, but steps overlapped within CALM_S
        board.end()
        monkeypatch.setattr(idle_cores, "CALM_S", 0.0)
        assert board.begin(1) == 4          # once that has passed: every core again
        board.end()
    finally:
        child.kill()
        child.join(30)


def test_a_dead_replicas_mark_ages_out_and_its_slot_is_taken_again(tmp_path, monkeypatch):
    path = tmp_path / "cores"
    board = CoreBoard(path, cores=2)
    child, _ = _other(path)
    os.kill(child.pid, signal.SIGKILL)       # dies mid-step, its mark left behind
    child.join(30)
    monkeypatch.setattr(idle_cores, "CALM_S", 0.0)
    assert board.begin(1) == 1               # its mark counts while it is recent
    board.end()
    monkeypatch.setattr(idle_cores, "STALE_S", 0.0)
    assert board.begin(1) == 2               # and not once it is older than STALE_S
    board.end()
    monkeypatch.setattr(idle_cores, "STALE_S", 30.0)
    again = CoreBoard(path, cores=2)         # a new replica takes the dead one's slot
    assert again._slot == 1
    assert board.begin(1) == 2
    board.close()
    again.close()


def test_usable_cores_is_within_the_affinity():
    assert 1 <= usable_cores() <= len(os.sched_getaffinity(0))
