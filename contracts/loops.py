"""Every background loop (the KeysManager's watcher, the provider's reconciler, the load
generator's sampler, the autoscaler's ticks) runs under one of these: a step that raises is
logged with its traceback and the loop goes on at its period, so one Redis error never silently
ends a loop that keeps the service up. Only cancellation (or `stop`) ends them."""
from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from collections.abc import Callable


def _failed(log: logging.Logger, name: str, exc: BaseException) -> None:
    # Connection trouble is expected while a dependency restarts: one line, not a traceback.
    if isinstance(exc, (ConnectionError, OSError, TimeoutError)) or type(exc).__module__.startswith("redis"):
        log.warning("%s: step failed: %s: %s", name, type(exc).__name__, exc)
    else:
        log.exception("%s: step failed", name)


async def every(period_s: float, step: Callable[[], object], log: logging.Logger, name: str) -> None:
    """Runs `step` (a function or a coroutine function) every `period_s` until cancelled."""
    while True:
        started = time.monotonic()
        try:
            result = step()
            if inspect.isawaitable(result):
                await result
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the loop must outlive any one step
            _failed(log, name, exc)
        await asyncio.sleep(max(0.0, period_s - (time.monotonic() - started)))


def every_in_thread(period_s: float, step: Callable[[], object], stop: Callable[[], bool],
                    log: logging.Logger, name: str) -> None:
    """Runs `step` every `period_s` in this thread until `stop()` is true."""
    while not stop():
        started = time.monotonic()
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - the loop must outlive any one step
            _failed(log, name, exc)
        time.sleep(max(0.0, period_s - (time.monotonic() - started)))


def start_thread(period_s: float, step: Callable[[], object], stop: threading.Event, log: logging.Logger,
                 name: str) -> threading.Thread:
    """`every_in_thread` in a daemon thread of its own."""
    thread = threading.Thread(target=every_in_thread, args=(period_s, step, stop.is_set, log, name), name=name,
                              daemon=True)
    thread.start()
    return thread
