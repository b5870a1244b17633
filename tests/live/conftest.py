"""Fixtures of the tests that call the session's embedded runtime (tests/conftest.py starts it)."""
from __future__ import annotations

import pytest
import redis
from transformers import AutoTokenizer

from contracts.http_client import GatewayClient


@pytest.fixture(scope="module")
def client(runtime) -> GatewayClient:
    return GatewayClient.for_settings(runtime)


@pytest.fixture(scope="module")
def r(runtime) -> redis.Redis:
    return redis.Redis.from_url(runtime.redis_url)


@pytest.fixture(scope="module")
def tokenizer(partitioned):
    return AutoTokenizer.from_pretrained(partitioned("smollm2", 4).tokenizer_path())
