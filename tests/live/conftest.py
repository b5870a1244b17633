"""Fixtures of the tests that call the session's embedded runtime (tests/conftest.py starts it),
and a KeysManager of its own for the tests that fork."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from transformers import AutoTokenizer

from containers.images import build_images
from containers.podman import missing
from contracts.config import Settings, child_environment
from contracts.http_client import GatewayClient
from contracts.paths import REPO_ROOT as REPO
from keysmanager.client import KeysClient
from runtime.ports import free_port
from runtime.redis_server import start_redis
from tests.live.runtime_helpers import wait_until

NEEDS_CONTAINERS = pytest.mark.skipif(missing() is not None, reason=f"containers cannot run here: {missing()}")


@pytest.fixture(scope="module")
def client(runtime) -> GatewayClient:
    return GatewayClient.for_settings(runtime)


@pytest.fixture(scope="module")
def r(runtime) -> redis.Redis:
    return redis.Redis.from_url(runtime.redis_url)


@pytest.fixture(scope="module")
def tokenizer(partitioned):
    return AutoTokenizer.from_pretrained(partitioned("smollm2", 4).tokenizer_path())


def _own_redis(folder):
    port = free_port()
    proc = start_redis("127.0.0.1", port, folder, folder / "redis.log")
    try:
        yield port
    finally:
        proc.terminate()
        proc.wait()


@pytest.fixture
def redis_port(tmp_path):
    """A redis-server of the test's own on a free port, stopped afterwards."""
    yield from _own_redis(tmp_path)


@pytest.fixture(scope="module")
def module_redis_port(tmp_path_factory):
    """A redis-server of the module's own, for module-scoped fixtures."""
    yield from _own_redis(tmp_path_factory.mktemp("redis"))


@contextlib.contextmanager
def keysmanager(home_settings: Settings, home: Path, redis_port: int, **changes) -> Iterator[tuple[Settings, KeysClient]]:
    """A KeysManager process over the test models, with its home at `home` and the settings
    `changes` make; stopped afterwards."""
    settings = home_settings.replace(home=str(home), models=str(home_settings.models_dir), redis_port=redis_port,
                                     keysmanager_port=free_port(), server="km-test", **changes)
    (home / "logs").mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "keysmanager"], env=child_environment(settings), cwd=REPO,
                            stdout=open(home / "logs" / "keysmanager.log", "ab"), stderr=subprocess.STDOUT)
    client = KeysClient.for_settings(settings, timeout=300)
    try:
        wait_until(client.healthy, 60, "the KeysManager")
        yield settings, client
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.fixture(scope="module")
def km(home_settings: Settings, partitioned, tmp_path_factory, module_redis_port):
    """A redis-server and a KeysManager process of their own, over the test models."""
    partitioned("smollm2", 4)
    partitioned("minilm", 3)
    children: list[int] = []
    with keysmanager(home_settings, tmp_path_factory.mktemp("km"), module_redis_port) as (settings, client):
        try:
            yield settings, client, redis.Redis.from_url(settings.redis_url), children
        finally:
            for pid in children:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


@pytest.fixture(scope="session")
def images(home_settings) -> set[str]:
    """The images of stack.yml and Redis's, built as `make images` builds them (layers cached)."""
    return {b["image"] for b in build_images(home_settings, REPO / "stack.yml")}
