"""Keeps the provider (runtime/server.py) running: `python -m runtime up` starts this, which
holds the gateway's listening socket and starts the provider on it. A provider that dies when
nobody stopped it is started again with `--adopt`: it takes over the Redis, KeysManagers,
autoscaler and replicas the dead one left running (runtime/state_file.py), so the runtime serves
again within seconds; connections that arrive meanwhile wait in the socket's backlog instead of
being refused. Requests that the dead provider had accepted lose their connection, as with any
gateway process that dies. SIGTERM is passed on to the provider, which drains and stops; then
this exits with it. A provider that fails within STARTUP_S of the first start (a bad setting, a
port in use) is not started again: `up` reports it."""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time

from contracts import logs as log_format
from contracts.config import exit_on_config_error, load_settings

log = logging.getLogger("quart.guardian")
# A provider that ran STABLE_S is started again at once; one that keeps dying sooner waits longer
# each time (a crash at start must not loop).
STARTUP_S, MIN_BACKOFF_S, MAX_BACKOFF_S, STABLE_S = 5.0, 0.2, 10.0, 10.0
PR_SET_CHILD_SUBREAPER = 36


def _become_subreaper() -> None:
    """Processes of a provider that died become this one's children (not init's), so they are
    reaped here rather than left as zombies. Linux only; elsewhere they go to init."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _listen(host: str, port: int) -> socket.socket:
    sock = socket.create_server((host, port), backlog=1024, reuse_port=False)
    sock.set_inheritable(True)
    return sock


def _start(sock: socket.socket, restarts: int, last_exit: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "runtime.server", "--gateway-fd", str(sock.fileno())]
    if restarts:
        cmd += ["--adopt", "--restarts", str(restarts), "--last-exit", last_exit]
    return subprocess.Popen(cmd, pass_fds=(sock.fileno(),), stdin=subprocess.DEVNULL)


def _exit_of(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit code {os.waitstatus_to_exitcode(status)}"


def main() -> int:
    settings = exit_on_config_error(load_settings)
    log_format.configure(settings.log_level, settings.log_format)
    _become_subreaper()
    sock = _listen(settings.gateway.host, settings.gateway.port)
    stopping = []
    provider = _start(sock, 0, "")
    started, restarts, backoff = time.monotonic(), 0, MIN_BACKOFF_S

    def stop(*_: object) -> None:
        stopping.append(True)
        provider.send_signal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while True:
        pid, status = os.waitpid(-1, 0)   # the provider, or an orphan of a dead one to reap
        if pid != provider.pid:
            continue
        provider.returncode = os.waitstatus_to_exitcode(status)
        if stopping or (restarts == 0 and time.monotonic() - started < STARTUP_S):
            return provider.returncode if provider.returncode >= 0 else 1
        last_exit = _exit_of(status)
        backoff = MIN_BACKOFF_S if time.monotonic() - started > STABLE_S else min(MAX_BACKOFF_S, backoff * 2)
        restarts += 1
        log.error("the provider died (%s); starting it again (%d) in %.1f s", last_exit, restarts, backoff)
        time.sleep(backoff)
        if stopping:
            return 0
        provider, started = _start(sock, restarts, last_exit), time.monotonic()


if __name__ == "__main__":
    sys.exit(main())
