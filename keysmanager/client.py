"""Client of a server's KeysManager API (see keysmanager/api.py)."""
from __future__ import annotations

import time

from contracts.config import Settings
from contracts.http_client import HttpClient
from contracts.stage import StageRef


class KeysManagerError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class KeysClient(HttpClient):
    @classmethod
    def for_settings(cls, settings: Settings, timeout: float = 600.0) -> KeysClient:
        """The client of the KeysManager that `settings` name (its port), with the internal token."""
        return cls.at("127.0.0.1", settings, timeout)

    @classmethod
    def at(cls, host: str, settings: Settings, timeout: float = 600.0) -> KeysClient:
        """The client of the KeysManager on `host` (a pod's address on a cluster)."""
        client = cls(f"http://{host}:{settings.cache.port}", timeout)
        client.auth = f"Bearer {settings.internal_api_token()}"
        return client

    def _call(self, method: str, path: str, body: dict | None = None) -> object:
        reply = self.request(method, path, body)
        if reply.status != 200:
            try:
                message = reply.json().get("error", "")
            except ValueError:
                message = reply.body[:200].decode(errors="replace")
            raise KeysManagerError(reply.status, f"{method} {path}: {reply.status} {message}")
        return reply.json()

    def cache(self, stage: StageRef) -> dict:
        return self._call("POST", "/cache", {"model": stage.model, "stages": stage.stages})

    def fork(self, stage: StageRef, function: str, env: dict[str, str] | None = None, cow: bool = True) -> dict:
        return self._call("POST", "/fork", {"model": stage.model, "stages": stage.stages, "function": function,
                                            "env": env or {}, "cow": cow})

    def start_cold(self, stage: StageRef, function: str, env: dict[str, str] | None = None) -> dict:
        return self._call("POST", "/start", {"model": stage.model, "stages": stage.stages, "function": function,
                                             "env": env or {}})

    def evict(self, stage: StageRef) -> dict:
        return self._call("POST", "/evict", {"model": stage.model, "stages": stage.stages})

    def prefetch(self, stage: StageRef) -> dict:
        return self._call("POST", "/prefetch", {"model": stage.model, "stages": stage.stages})

    def prefetches(self) -> list[dict]:
        return self._call("GET", "/prefetch")

    def cancel_prefetch(self, model: str) -> dict:
        return self._call("DELETE", f"/prefetch/{model}")

    def forks(self) -> list[dict]:
        return self._call("GET", "/forks")

    def stop(self, pid: int) -> dict:
        return self._call("POST", "/stop", {"pid": pid})

    def zygotes(self) -> list[dict]:
        return self._call("GET", "/zygotes")

    def settled(self, stage: StageRef, timeout_s: float = 1800.0, poll_s: float = 0.5) -> dict:
        """The stage's zygote once its compile has settled ("done", "failed" or "off": forks from
        then on are as compiled as they will be); TimeoutError past `timeout_s`, KeyError where the
        stage is not cached."""
        deadline = time.monotonic() + timeout_s
        while True:
            zygote = next((z for z in self.zygotes() if (z["model"], z["stages"]) == (stage.model, stage.stages)), None)
            if zygote is None:
                raise KeyError(f"{stage} is not cached")
            if zygote["compile"] != "compiling":
                return zygote
            if time.monotonic() > deadline:
                raise TimeoutError(f"{stage}'s zygote still compiling after {timeout_s:g} s")
            time.sleep(poll_s)

    def stats(self) -> dict:
        return self._call("GET", "/stats")

    def receive(self, model: str, shard: str, pulls: list[dict], fallbacks: list[str]) -> dict:
        """Starts receiving a shard from peers: `pulls` [{"source", "first", "end"}] in order."""
        return self._call("POST", "/multicast", {"model": model, "shard": shard, "pulls": pulls, "fallbacks": fallbacks})

    def receptions(self) -> list[dict]:
        return self._call("GET", "/multicast")

    def cancel_receptions(self, model: str) -> dict:
        return self._call("DELETE", f"/multicast/{model}")

    def set_threshold(self, fraction: float) -> dict:
        return self._call("PUT", "/config", {"memory_threshold": fraction})
