"""A thread that yields to serving (a background compile) makes no progress while a serving turn
is in flight, and goes on once every turn has ended; real threads."""
from __future__ import annotations

import threading
import time

from models.serving_first import ServingFirst


def _work(gate: ServingFirst, count: list[int], stop: threading.Event, yielding: bool = True) -> threading.Thread:
    def step() -> None:
        count[0] += 1

    def run() -> None:
        if yielding:
            gate.yield_to_serving()
        try:
            while not stop.is_set():
                step()
        finally:
            gate.stop_yielding()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _advances(count: list[int], within_s: float = 10.0) -> bool:
    start, deadline = count[0], time.monotonic() + within_s
    while time.monotonic() < deadline:
        if count[0] > start:
            return True
        time.sleep(0.01)
    return False


def _parks(count: list[int], within_s: float = 10.0, still_s: float = 0.3) -> bool:
    """Whether the count stops changing (for `still_s`) within `within_s`."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        before = count[0]
        time.sleep(still_s)
        if count[0] == before:
            return True
    return False


def test_the_yielding_thread_parks_during_a_turn_and_goes_on_after_it():
    gate, count, stop = ServingFirst(), [0], threading.Event()
    worker = _work(gate, count, stop)
    try:
        assert _advances(count)
        with gate.turn():
            assert _parks(count)
            parked = count[0]
            time.sleep(0.3)
            assert count[0] == parked
        assert _advances(count)
    finally:
        stop.set()
        worker.join(10)
    assert not worker.is_alive()


def test_it_parks_until_every_overlapping_turn_has_ended():
    gate, count, stop = ServingFirst(), [0], threading.Event()
    worker = _work(gate, count, stop)
    first_done, second_may_end = threading.Event(), threading.Event()

    def second_turn() -> None:
        with gate.turn():
            first_done.wait(10)
            second_may_end.wait(10)
    try:
        assert _advances(count)
        with gate.turn():
            other = threading.Thread(target=second_turn)
            other.start()
            assert _parks(count)
        first_done.set()
        parked = count[0]
        time.sleep(0.3)
        assert count[0] == parked   # the second turn is still in flight
        second_may_end.set()
        other.join(10)
        assert _advances(count)
    finally:
        stop.set()
        second_may_end.set()
        worker.join(10)


def test_a_thread_that_does_not_yield_runs_through_a_turn():
    gate, count, stop = ServingFirst(), [0], threading.Event()
    worker = _work(gate, count, stop, yielding=False)
    try:
        with gate.turn():
            assert _advances(count)
            time.sleep(0.3)
            assert _advances(count)
    finally:
        stop.set()
        worker.join(10)


def test_a_turn_waits_while_the_yielding_thread_changes_what_every_thread_runs():
    """Inside torch.fx's symbolic trace (every thread's Module.__call__ patched) the yielding thread
    does not park, and a turn starts only once the window has ended."""
    unsafe = threading.Event()
    unsafe.set()
    gate, count, stop = ServingFirst(unsafe.is_set), [0], threading.Event()
    worker = _work(gate, count, stop)
    entered, parked = threading.Event(), []

    def serve() -> None:
        with gate.turn():
            entered.set()
            parked.append(_parks(count))
    server = threading.Thread(target=serve)
    try:
        assert _advances(count)
        server.start()
        time.sleep(0.3)
        assert not entered.is_set()   # the turn waits for the window to end
        assert _advances(count)       # and the yielding thread runs on through it
        unsafe.clear()
        assert entered.wait(10)
        server.join(20)
        assert parked == [True]
    finally:
        stop.set()
        unsafe.clear()
        worker.join(10)


def test_the_process_gate_asks_torch_fx_whether_a_trace_is_patching():
    import torch

    from models.serving_first import SERVING_FIRST
    seen = []

    class Probe(torch.nn.Module):
        def forward(self, x):
            seen.append(SERVING_FIRST._unsafe())
            return x + 1
    torch.fx.symbolic_trace(Probe())
    assert seen == [True] and not SERVING_FIRST._unsafe()
