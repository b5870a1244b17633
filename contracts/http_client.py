"""Small synchronous JSON-over-HTTP clients: of an OpenFaaS gateway (the embedded one or a real
one), and the base that the KeysManager's client shares."""
from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from dataclasses import dataclass

from contracts.config import Settings


@dataclass
class Reply:
    status: int
    body: bytes
    headers: dict[str, str]

    def json(self) -> object:
        return json.loads(self.body)


class HttpClient:
    def __init__(self, url: str, timeout: float = 180.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.auth: str | None = None

    def request(self, method: str, path: str, body: bytes | dict | list | None = None,
                headers: dict[str, str] | None = None, auth: bool = True) -> Reply:
        headers = dict(headers or {})
        if isinstance(body, (dict, list)):
            body = json.dumps(body).encode()
            headers.setdefault("Content-Type", "application/json")
        if auth and self.auth:
            headers["Authorization"] = self.auth
        req = urllib.request.Request(self.url + path, data=body, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return Reply(resp.status, resp.read(), dict(resp.headers))
        except urllib.error.HTTPError as exc:
            return Reply(exc.code, exc.read(), dict(exc.headers))

    def healthy(self, path: str = "/healthz") -> bool:
        try:
            return self.request("GET", path, auth=False).status == 200
        except OSError:
            return False


class GatewayClient(HttpClient):
    def __init__(self, url: str, user: str | None = None, password: str | None = None,
                 timeout: float = 180.0) -> None:
        super().__init__(url, timeout)
        if user is not None and password is not None:
            self.auth = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()

    @classmethod
    def for_settings(cls, settings: Settings) -> GatewayClient:
        return cls(settings.gateway.url, settings.gateway.user, settings.gateway_password(),
                   settings.data.request_timeout_s + 30)

    def invoke(self, function: str, body: bytes | dict) -> Reply:
        return self.request("POST", f"/function/{function}", body, auth=False)

    def functions(self) -> list[dict]:
        reply = self.request("GET", "/system/functions")
        if reply.status != 200:
            raise RuntimeError(f"GET /system/functions answered {reply.status}: {reply.body[:200]!r}")
        return reply.json()

    def scale(self, function: str, replicas: int, namespace: str = "openfaas-fn") -> Reply:
        return self.request("POST", f"/system/scale-function/{function}",
                            {"serviceName": function, "namespace": namespace, "replicas": replicas})
