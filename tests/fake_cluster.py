"""What cannot run here, faked on loopback for the Kubernetes backend's tests, and every request it
gets checked against the real API:

- a Kubernetes API server answering a recorded scenario (nodes and pods, themselves valid
  against the Kubernetes 1.33 schemas). Each request must be an operation of the Kubernetes API
  (method and path, as the official client was generated from its OpenAPI description), a PATCH
  must say a content type that fits its body, and a body must validate as the object it patches.
- an OpenFaaS gateway's /system/functions and /system/scale-function, each request validated
  against docs/openapi.yml (the OpenFaaS gateway's API)."""
from __future__ import annotations

import asyncio
import copy
import json
import re
import threading
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import kubernetes
import kubernetes_validate
from aiohttp import web
from openapi_core.testing import MockRequest

from tests.openapi_check import SPEC_HOST, spec

K8S_VERSION = "1.33.0"
OPERATION = re.compile(r"method='(\w+)',\s*resource_path='([^']+)'")


@lru_cache(maxsize=1)
def operations() -> list[tuple[str, re.Pattern]]:
    """(method, path pattern) of every operation of the Kubernetes API, read from the official
    Python client's generated API classes."""
    folder = Path(kubernetes.client.__file__).parent / "api"
    ops = set()
    for source in folder.glob("*_api.py"):
        ops |= set(OPERATION.findall(source.read_text()))
    return [(m, re.compile("^" + re.sub(r"\{[^}]+\}", "[^/]+", p) + "$")) for m, p in sorted(ops)]


def is_operation(method: str, path: str) -> bool:
    return any(m == method and pattern.match(path) for m, pattern in operations())


@dataclass
class Request:
    method: str
    path: str
    query: dict
    content_type: str
    body: object


def node(name: str, cpus: str) -> dict:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}, "spec": {},
            "status": {"allocatable": {"cpu": cpus, "memory": "16Gi"},
                       "conditions": [{"type": "Ready", "status": "True"}]}}


def pod(name: str, node_name: str, labels: dict, namespace: str, ip: str = "10.0.0.9", ready: bool = True,
        started: str = "2026-11-23T10:00:00Z") -> dict:
    container = labels.get("faas_function") or "keysmanager"
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": labels},
            "spec": {"nodeName": node_name, "containers": [{"name": container, "image": "quart/stage:0.1.0"}]},
            "status": {"phase": "Running", "podIP": ip, "startTime": started,
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


@dataclass
class FakeKubernetes:
    nodes: list[dict]
    pods: list[dict]
    requests: list[Request] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        record = Request(request.method, request.path, dict(request.query), request.content_type,
                         json.loads(body) if body else None)
        self.requests.append(record)
        if request.method == "GET" and request.path == "/api/v1/nodes":
            return web.json_response({"apiVersion": "v1", "kind": "NodeList", "metadata": {}, "items": self.nodes})
        if request.method == "GET" and request.path.endswith("/pods"):
            return web.json_response({"apiVersion": "v1", "kind": "PodList", "metadata": {},
                                      "items": [p for p in self.pods if _selected(p, request.query.get("labelSelector"))]})
        if request.method == "PATCH":
            name = request.path.split("/")[6]
            found = next((p for p in self.pods if p["metadata"]["name"] == name), None)
            return web.json_response(found) if found else web.json_response({"kind": "Status", "code": 404}, status=404)
        return web.json_response({"kind": "Status", "code": 404}, status=404)

    def check(self) -> None:
        """Every request an operation of the API, with a body valid as what it patches."""
        for r in self.requests:
            assert is_operation(r.method, r.path), f"{r.method} {r.path} is no operation of the Kubernetes API"
            if r.method != "PATCH":
                continue
            assert r.content_type in ("application/strategic-merge-patch+json", "application/merge-patch+json"), \
                f"{r.path}: an object patch sent as {r.content_type}"
            kubernetes_validate.validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
                                          **copy.deepcopy(r.body)}, K8S_VERSION, strict=True)

    def validate_scenario(self) -> None:
        for item in self.nodes + self.pods:
            kubernetes_validate.validate(item, K8S_VERSION, strict=True)


def _selected(item: dict, selector: str | None) -> bool:
    labels = item["metadata"].get("labels") or {}
    for term in filter(None, (selector or "").split(",")):
        key, _, value = term.partition("=")
        if key not in labels or (value and labels[key] != value):
            return False
    return True


@dataclass
class FakeGateway:
    replicas: dict[str, int]
    requests: list[tuple[str, str, dict | None]] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        scale = request.path.startswith("/system/scale-function/")
        pattern = "/system/scale-function/{functionName}" if scale else request.path
        spec().validate_request(MockRequest(SPEC_HOST, request.method, request.path, path_pattern=pattern, data=body,
                                            view_args={"functionName": request.path.rsplit("/", 1)[1]} if scale else None,
                                            content_type=request.content_type,
                                            headers={"Authorization": request.headers.get("Authorization", "")}))
        self.requests.append((request.method, request.path, json.loads(body) if body else None))
        if request.path == "/system/functions":
            return web.json_response([{"name": n, "image": "quart/stage:0.1.0", "replicas": r, "availableReplicas": r,
                                       "invocationCount": 0} for n, r in self.replicas.items()])
        data = json.loads(body)
        self.replicas[data["serviceName"]] = data["replicas"]
        return web.Response(status=202)


class Served:
    """A fake's `handle` answering every path, on a loopback port, in a thread of its own."""

    def __init__(self, handle) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(app)
        ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, args=(ready,), daemon=True)
        self.thread.start()
        ready.wait(10)

    def _serve(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        ready.set()
        self.loop.run_forever()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
