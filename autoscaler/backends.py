"""How replica and CPU changes take effect: one small interface, and its implementations.

- GatewayBackend: any OpenFaaS gateway (basic auth): replicas through /system/scale-function,
  each stage function by the name the stack file gives it. OpenFaaS CE clamps scale-function to
  1..5 replicas; CPU changes would need a redeploy there, so they are not made.
- LocalBackend: the embedded runtime's gateway, plus live CPU changes: replicas read the wanted
  CPUs of their stage function from Redis and apply them between work items, without a restart.
"""
from __future__ import annotations

import logging
from typing import Protocol

from contracts.http_client import GatewayClient
from contracts.stack import Pipeline
from contracts.stage import StageRef
from scheduler.coldstart import ColdServer
from state.store import Store

log = logging.getLogger("quart.backend")


class Backend(Protocol):
    def desired_replicas(self) -> dict[str, list[int]]: ...
    def set_replicas(self, stage: StageRef, replicas: int) -> None: ...
    def set_cpus(self, stage: StageRef, cpus: int) -> None: ...
    # A function outside the pipelines (a model's whole-model function), by name.
    def function_replicas(self, name: str) -> int: ...
    def scale_function(self, name: str, replicas: int) -> None: ...
    # Where a sleeping model may wake (Algorithm 1's servers; none: no view of them), and what a
    # cold start of a stage reads.
    def cold_servers(self, load_rate: float) -> list[ColdServer]: ...
    def shard_bytes(self, stage: StageRef) -> float: ...


class GatewayFunctions:
    """Replicas of any function by name, through the gateway's API."""
    client: GatewayClient

    def function_replicas(self, name: str) -> int:
        reply = self.client.request("GET", f"/system/function/{name}")
        if reply.status != 200:
            raise RuntimeError(f"reading {name}: {reply.status} {reply.body[:200]!r}")
        return int(reply.json()["replicas"])

    def scale_function(self, name: str, replicas: int) -> None:
        reply = self.client.scale(name, replicas)
        if reply.status not in (200, 202):
            raise RuntimeError(f"scaling {name} to {replicas}: {reply.status} {reply.body[:200]!r}")


class GatewayBackend(GatewayFunctions):
    def __init__(self, client: GatewayClient, pipelines: dict[str, Pipeline]) -> None:
        self.client = client
        self.pipelines = pipelines
        self._warned = False

    def desired_replicas(self) -> dict[str, list[int]]:
        """Each model's stage functions' replica counts, as the gateway reports them."""
        by_name = {f["name"]: int(f["replicas"]) for f in self.client.functions()}
        return {m: [by_name.get(name, 0) for name in p.functions] for m, p in self.pipelines.items()}

    def set_replicas(self, stage: StageRef, replicas: int) -> None:
        self.scale_function(self.pipelines[stage.model].function(stage), replicas)

    def cold_servers(self, load_rate: float) -> list[ColdServer]:
        """None known: a gateway does not say where replicas run (the embedded runtime's gateway
        chooses a waking model's layout itself, on the request's way in)."""
        return []

    def shard_bytes(self, stage: StageRef) -> float:
        return 0.0

    def set_cpus(self, stage: StageRef, cpus: int) -> None:
        if not self._warned:
            log.warning("this gateway backend cannot change CPUs of running replicas; CPU decisions are logged only")
            self._warned = True


class LocalBackend(GatewayBackend):
    def __init__(self, client: GatewayClient, pipelines: dict[str, Pipeline], store: Store) -> None:
        super().__init__(client, pipelines)
        self.store = store

    def set_cpus(self, stage: StageRef, cpus: int) -> None:
        self.store.set_stage_cpus(stage, cpus)
