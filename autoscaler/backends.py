"""How decisions take effect: one small interface, and its implementations.

- GatewayBackend: any OpenFaaS gateway (basic auth): replicas through /system/scale-function.
  Stage `i` of `model` is the function `<model>-s<i>`. OpenFaaS CE clamps scale-function to
  1..5 replicas; CPU changes would need a redeploy there, so they are not made.
- LocalBackend: the embedded runtime's gateway, plus live CPU changes: replicas read the wanted
  CPUs of their stage from Redis and apply them between work items, without a restart.
"""
from __future__ import annotations

import logging
from typing import Protocol

import redis

from contracts import keys
from contracts.http_client import GatewayClient

log = logging.getLogger("quart.backend")


class Backend(Protocol):
    def desired_replicas(self, model: str, num_stages: int) -> list[int]: ...
    def set_replicas(self, model: str, stage: int, replicas: int) -> None: ...
    def set_cpus(self, model: str, stage: int, cpus: int) -> None: ...


def function_name(model: str, stage: int) -> str:
    return f"{model}-s{stage}"


class GatewayBackend:
    def __init__(self, client: GatewayClient) -> None:
        self.client = client
        self._warned = False

    def desired_replicas(self, model: str, num_stages: int) -> list[int]:
        by_name = {f["name"]: int(f["replicas"]) for f in self.client.functions()}
        return [by_name.get(function_name(model, i), 0) for i in range(num_stages)]

    def set_replicas(self, model: str, stage: int, replicas: int) -> None:
        reply = self.client.scale(function_name(model, stage), replicas)
        if reply.status not in (200, 202):
            raise RuntimeError(f"scaling {function_name(model, stage)} to {replicas}: "
                               f"{reply.status} {reply.body[:200]!r}")

    def set_cpus(self, model: str, stage: int, cpus: int) -> None:
        if not self._warned:
            log.warning("this gateway backend cannot change CPUs of running replicas; CPU decisions are logged only")
            self._warned = True


class LocalBackend(GatewayBackend):
    def __init__(self, client: GatewayClient, r: redis.Redis) -> None:
        super().__init__(client)
        self.redis = r

    def set_cpus(self, model: str, stage: int, cpus: int) -> None:
        self.redis.set(keys.stage_cpus(model, stage), str(cpus))
