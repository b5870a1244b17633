"""A process that is not this one's child, watched by its pid: a replica forked by a KeysManager
zygote, or a component or replica that a provider which died had started (adopted by the one
started in its place). Its start time, recorded with the pid, tells it from a later process that
was given the same pid."""
from __future__ import annotations

import os
import signal
import subprocess
import time

from contracts.proc_stat import start_time


class WatchedProcess:
    """What the runtime uses of a subprocess.Popen, by pid."""

    def __init__(self, pid: int, start_ticks: int | None = None) -> None:
        self.pid = pid
        self.start_ticks = start_time(pid) if start_ticks is None else start_ticks
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and (self.start_ticks is None or start_time(self.pid) != self.start_ticks):
            self.returncode = -1  # another process reaps it: the code is not ours to see
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode
