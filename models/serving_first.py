"""Serving before a background compile, in one process. A compile on a thread of its own (a
replica not forked from a compiled zygote, `models/compiled_decode.py`) is Python for most of its
minutes: tracing, lowering, code generation. Every torch operation of a serving step gives up
Python's lock and must take it back; with the compiling thread running on a core of its own, each
take-back waits for that thread's switch interval (5 ms), and a whole SmolLM2 step of 45 ms took
8 to 20 s on a quiet 2-core host while the compile ran (measured 2026-12-04). The OS priority of
the compile's thread cannot help: the lock is Python's, not the scheduler's.

So the compiling thread parks, at its next Python call or return, while any serving turn is in
flight (`turn`), and runs in the gaps between turns. It still takes the lock for at most a switch
interval at a turn's start (it may hold the lock when the turn begins). Under load with no gaps the
compile waits; eager steps serve meanwhile, as they do before it ends.

Never while it changes what the whole process runs: torch.fx's symbolic tracer (which inductor
runs on its patterns) replaces `torch.nn.Module.__call__` for every thread while it traces, and a
serving step in that window fails ("module is not installed as a submodule", seen with the compile
parked there). A turn waits for such a window to end, and the compile does not park inside one.
The same window was open to serving before, for as long as the tracer held Python's lock."""
from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch.fx._symbolic_trace as fx_trace

UNSAFE_POLL_S = 0.001


def fx_patching() -> bool:
    """Whether torch.fx's symbolic tracer has patched the process: its own flag, read directly
    (private; torch's `is_fx_tracing()` reads the same and logs a deprecation warning)."""
    return fx_trace._is_fx_tracing_flag


class ServingFirst:
    def __init__(self, unsafe_to_interleave: Callable[[], bool] = fx_patching) -> None:
        """`unsafe_to_interleave()`: whether a thread is changing state every thread runs on."""
        self._unsafe = unsafe_to_interleave
        self._lock = threading.Lock()
        self._turns = 0
        self._clear = threading.Event()  # set: no turn in flight
        self._clear.set()

    @contextmanager
    def turn(self) -> Iterator[None]:
        """A serving turn: a thread under `yield_to_serving` parks until every turn has ended."""
        with self._lock:
            self._turns += 1
            self._clear.clear()
        try:
            while self._unsafe():  # the compile finishes what every thread would see, then parks
                time.sleep(UNSAFE_POLL_S)
            yield
        finally:
            with self._lock:
                self._turns -= 1
                if self._turns == 0:
                    self._clear.set()

    def yield_to_serving(self) -> None:
        """From now on the calling thread parks while a turn is in flight (a profile hook, which
        Python calls on this thread's every function call and return; `stop_yielding` removes it)."""
        is_clear, wait, unsafe = self._clear.is_set, self._clear.wait, self._unsafe

        def hook(frame: object, event: str, arg: object) -> None:
            if not is_clear() and not unsafe():
                wait()
        sys.setprofile(hook)

    @staticmethod
    def stop_yielding() -> None:
        sys.setprofile(None)


# One per process: Python's lock is the process's.
SERVING_FIRST = ServingFirst()
