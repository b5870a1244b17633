"""Keeps the embedded runtime's own components running (Redis, the KeysManagers, the autoscaler):
one that exits when nobody stopped it is started again, after a back-off that doubles with each
quick failure (a component that cannot start must not be restarted in a tight loop) and resets
once it has run for STABLE_S. Its state is what `/healthz` and `python -m runtime status` show."""
from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from runtime.watched_process import WatchedProcess, start_time

log = logging.getLogger("quart.supervisor")

MIN_BACKOFF_S, MAX_BACKOFF_S, STABLE_S, CHECK_S = 0.5, 10.0, 10.0, 0.2


@dataclass
class Component:
    name: str
    start: Callable[[], subprocess.Popen]
    proc: subprocess.Popen | WatchedProcess | None = None
    started_at: float = 0.0
    restarts: int = 0
    backoff_s: float = MIN_BACKOFF_S
    retry_at: float = 0.0
    last_exit: str = ""
    order: int = field(default=0, compare=False)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def status(self) -> dict:
        return {"running": self.running, "restarts": self.restarts, "last_exit": self.last_exit}


class Supervisor:
    def __init__(self) -> None:
        self.components: dict[str, Component] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, name: str, start: Callable[[], subprocess.Popen], previous: dict | None = None) -> None:
        """Watches a component from now on: the process `previous` records (see `snapshot`) where
        it still runs (a provider that died had started it), else one started now (an error here
        is the caller's)."""
        c = Component(name, start, order=len(self.components))
        adopted = WatchedProcess(previous["pid"], previous["start_ticks"]) if previous else None
        if adopted is not None and adopted.poll() is None:
            c.proc = adopted
            log.info("%s (pid %d) adopted: it was running", name, adopted.pid)
        else:
            c.proc = start()
        c.started_at = time.monotonic()
        with self._lock:
            self.components[name] = c

    def snapshot(self) -> dict[str, dict]:
        """Each running component's pid and start time, for a provider started in this one's place."""
        with self._lock:
            return {name: {"pid": c.proc.pid, "start_ticks": start_time(c.proc.pid)}
                    for name, c in self.components.items() if c.running}

    def run(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="supervisor", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(CHECK_S):
            self.check(time.monotonic())

    def check(self, now: float) -> None:
        with self._lock:
            components = list(self.components.values())
        for c in components:
            if self._stop.is_set():
                return
            if c.running:
                if now - c.started_at >= STABLE_S:
                    c.backoff_s = MIN_BACKOFF_S
                continue
            if c.proc is not None:
                c.last_exit = f"exit code {c.proc.returncode}"
                log.error("%s exited (%s); starting it again in %.1f s", c.name, c.last_exit, c.backoff_s)
                c.proc, c.retry_at = None, now + c.backoff_s
                c.backoff_s = min(MAX_BACKOFF_S, c.backoff_s * 2)
            if now >= c.retry_at:
                self._restart(c, now)

    def _restart(self, c: Component, now: float) -> None:
        try:
            c.proc = c.start()
        except (OSError, RuntimeError, TimeoutError) as exc:
            c.last_exit = f"could not start: {exc}"
            log.error("%s %s; trying again in %.1f s", c.name, c.last_exit, c.backoff_s)
            c.retry_at = time.monotonic() + c.backoff_s
            c.backoff_s = min(MAX_BACKOFF_S, c.backoff_s * 2)
            return
        c.started_at, c.restarts = time.monotonic(), c.restarts + 1
        log.info("%s started again (pid %d, restart %d)", c.name, c.proc.pid, c.restarts)

    def status(self) -> dict[str, dict]:
        with self._lock:
            return {name: c.status() for name, c in self.components.items()}

    def down(self) -> list[str]:
        """The components not running now (being restarted, or waiting to be)."""
        return [name for name, s in self.status().items() if not s["running"]]

    def halt(self) -> None:
        """Stops watching: what exits from now on stays down (the runtime is stopping)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=15)

    def terminate(self, *names: str) -> None:
        """Ends the named components (all of them, the last started first, without names)."""
        self.halt()
        with self._lock:
            chosen = [self.components[n] for n in names if n in self.components] if names else \
                sorted(self.components.values(), key=lambda c: -c.order)
        for c in chosen:
            if c.running:
                c.proc.terminate()
                try:
                    c.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    c.proc.kill()
