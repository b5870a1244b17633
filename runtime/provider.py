"""The embedded runtime's local provider: the OpenFaaS gateway REST API (a copy of its spec in
tests/upstream/openfaas-gateway.openapi.yml) over local replica processes. `/system/*` needs basic auth."""
from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import logging
import platform
import re
import time
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from contracts.config import Settings
from contracts.http_errors import json_errors
from contracts.loops import every
from contracts.openai_errors import error_body
from contracts.requests import BadRequest, load_json
from contracts.stack import NAME_RE, SOURCE_VAR, StackFunction, ZeroScaling, identity, ttft_slo_s
from keysmanager.client import KeysClient
from models.families import Unsupported, check_folder
from models.manifest import Manifest
from models.sizes import stage_bytes
from runtime.activator import Activator
from runtime.function_logs import LogQuery, stream_logs
from runtime.functions import FunctionState, ProcessManager, ReplicaProcess
from runtime.placer import Placer
from runtime.state_file import save as save_state
from runtime.state_file import state_path
from runtime.supervisor import Supervisor
from runtime.wake_planner import WakePlanner
from state.store import Store, Unavailable

log = logging.getLogger("quart.provider")
VERSION = "0.1.0"
SCALE_MIN_LABEL = "com.openfaas.scale.min"
SCALE_MAX_LABEL = "com.openfaas.scale.max"
PROBE_PERIOD_S = 2.0
CPUS_CHECK_S = 1.0
FAILURE_THRESHOLD = 3
HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection"}


def _forwarded(headers: Mapping[str, str]) -> dict[str, str]:
    """A request's headers as a replica gets them: hop-by-hop ones dropped, and the gateway's own
    basic-auth credentials kept from function code (a bearer token, like the internal one, passes)."""
    return {k: v for k, v in headers.items() if k.lower() not in HOP_HEADERS
            and not (k.lower() == "authorization" and v.lower().startswith("basic "))}


def error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


class BadDeployment(ValueError):
    pass


class _ServiceCount:
    """OpenFaaS's `gateway_service_count{function_name}`: each function's ready replicas, read
    when scraped (what its gateway reports from the provider's available replicas)."""

    def __init__(self, functions: Mapping[str, FunctionState]) -> None:
        self._functions = functions

    def collect(self) -> list[GaugeMetricFamily]:
        family = GaugeMetricFamily("gateway_service_count", "Function replicas ready", labels=("function_name",))
        for name, fn in sorted(self._functions.items()):
            family.add_metric((name,), len(fn.ready()))
        return [family]


# Variables that make the loader or the interpreter run other code: a replica is a process on this
# host, not a container, so a deployment may not set them.
_UNSAFE_ENV = re.compile(r"LD_.*|DYLD_.*|PYTHON.*|PATH|BASH_ENV|ENV")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _check_env(env: dict[str, str]) -> None:
    for name, value in env.items():
        if not _ENV_NAME.fullmatch(name):
            raise BadDeployment(f"envVars: {name!r} is not a variable name")
        if _UNSAFE_ENV.fullmatch(name):
            raise BadDeployment(f"envVars: {name} would change how the replica's process runs; it may not be set")
        if "\0" in value:
            raise BadDeployment(f"envVars: {name}'s value holds a NUL byte")


class LocalProvider:
    def __init__(self, settings: Settings, stack: list[StackFunction], password: str,
                 keys: dict[str, KeysClient | None], store: Store,
                 supervisor: Supervisor | None = None, restarts: dict | None = None) -> None:
        """`keys`: the KeysManager of each virtual server; the scheduler places every replica.
        `supervisor`: the supervised components (runtime/supervisor.py), for /healthz and the
        state file; `restarts`: how often the provider itself was started again, and why."""
        self.settings = settings
        self.supervisor = supervisor
        self.restarts = restarts
        self._saved: dict = {}
        self.password = password
        # One bound for every function: QUART_R_MAX, lowered per function by com.openfaas.scale.max.
        self.max_replicas = settings.autoscaler.bounds.r_max
        # The local provider runs handlers, not images: an image is known by the stack entry
        # that builds it.
        self.handlers = {f.deployment["image"]: f.handler for f in stack}
        self.functions: dict[str, FunctionState] = {}
        # Deleted functions whose replicas are still finishing their work.
        self._draining: list[FunctionState] = []
        self.processes = ProcessManager(settings, keys)
        self.placer = Placer(settings, self.processes, store)
        self.activator = Activator(store, lambda fn: self._initial_replicas(fn.deployment), settings.data.request_timeout_s,
                                   WakePlanner(settings, store, self.placer.shard_bytes), settings.data.records_maxlen)
        self.registry = CollectorRegistry()
        self.invocations = Counter("gateway_function_invocation", "Function invocations",
                                   ("function_name", "code"), registry=self.registry)
        self.seconds = Histogram("gateway_functions_seconds", "Function invocation time",
                                 ("function_name", "code"), registry=self.registry)
        self.registry.register(_ServiceCount(self.functions))
        self._session: aiohttp.ClientSession | None = None
        self._reconciler: asyncio.Task | None = None
        self._cpus_checked = 0.0

    # -- function lifecycle --------------------------------------------------------------------

    def deploy(self, deployment: dict, update: bool = False) -> None:
        service = deployment.get("service") if isinstance(deployment, dict) else None
        if update and isinstance(service, str) and service not in self.functions:
            raise KeyError(service)   # 404 before what the body lacks
        deployment = self._validated(deployment)
        name = deployment["service"]
        existing = self.functions.get(name)
        if not update and existing is not None:
            raise BadDeployment(f"function {name!r} already exists; update it with PUT")
        desired = self._initial_replicas(deployment)
        fn = FunctionState(deployment, self.handlers[deployment["image"]], desired)
        if existing is not None:
            # An update replaces every replica: new ones start, the old ones drain.
            fn.desired, fn.created_at, fn.invocations = existing.desired, existing.created_at, existing.invocations
            for replica in existing.replicas:
                self.processes.drain(replica)
            fn.replicas = existing.replicas
        self.functions[name] = fn
        self.converge()

    def converge(self) -> None:
        self.placer.converge(list(self.functions.values()), self._draining)

    def _validated(self, d: object) -> dict:
        if not isinstance(d, dict):
            raise BadDeployment("the body must be a FunctionDeployment object")
        for key in ("service", "image"):
            if not isinstance(d.get(key), str) or not d[key]:
                raise BadDeployment(f"'{key}' is required and must be a string")
        if not NAME_RE.fullmatch(d["service"]) or len(d["service"]) > 63:
            raise BadDeployment(f"service {d['service']!r} is not a valid DNS-1123 label")
        if d["image"] not in self.handlers:
            raise BadDeployment(f"image {d['image']!r} is unknown to the local provider, which runs "
                                f"the handlers of its stack file: {sorted(self.handlers)}")
        d = dict(d)
        for key in ("envVars", "labels", "annotations", "limits", "requests"):
            value = d.get(key)
            if value is None:
                d[key] = {}   # OpenFaaS reads null as none
            elif not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
                raise BadDeployment(f"'{key}' must be an object of strings")
        _check_env(d["envVars"])
        try:
            model, stage = identity(d)
        except ValueError as exc:
            raise BadDeployment(f"envVars: {exc}") from None
        try:
            ZeroScaling.from_labels(d["labels"])
            ttft_slo_s(d["labels"])
        except ValueError as exc:
            raise BadDeployment(str(exc)) from None
        if not model:
            raise BadDeployment("envVars must name the function's model (QUART_MODEL)")
        if stage is None and Path(self.handlers[d["image"]]).name == "stage":
            raise BadDeployment(f"image {d['image']!r} is a stage: envVars must name its stages (QUART_STAGES)")
        source = Path(d["envVars"].get(SOURCE_VAR, "")).expanduser()
        if source.is_absolute() and source.is_dir():
            try:
                check_folder(source)
            except Unsupported as exc:
                raise BadDeployment(f"envVars: {SOURCE_VAR}: {exc}") from None
        if stage is not None:
            try:  # a stage of a model this runtime cannot serve would only fail to start, again and again
                stage_bytes(self.settings.models_dir, model, stage.first, stage.last)
            except (FileNotFoundError, ValueError) as exc:
                raise BadDeployment(f"envVars: {exc}") from None
        return d

    def _initial_replicas(self, d: dict) -> int:
        raw = (d.get("labels") or {}).get(SCALE_MIN_LABEL, "1")
        try:
            return max(1, min(int(raw), self._max_for(d)))
        except ValueError:
            raise BadDeployment(f"label {SCALE_MIN_LABEL}={raw!r} is not an integer") from None

    def _max_for(self, d: dict) -> int:
        raw = (d.get("labels") or {}).get(SCALE_MAX_LABEL)
        return min(int(raw), self.max_replicas) if raw and raw.isdigit() else self.max_replicas

    def scale(self, name: str, replicas: int) -> None:
        fn = self.functions[name]
        limit = self._max_for(fn.deployment)
        if not 0 <= replicas <= limit:
            raise BadDeployment(f"replicas must be in 0..{limit}, got {replicas}")
        fn.desired = replicas
        self.converge()

    def delete(self, name: str) -> None:
        fn = self.functions.pop(name)
        fn.desired = 0
        for replica in fn.replicas:
            self.processes.drain(replica)
        self._draining.append(fn)

    def status(self, fn: FunctionState) -> dict:
        d = fn.deployment
        out = {
            "name": fn.name, "image": d["image"], "namespace": self.settings.gateway.namespace,
            "envProcess": d.get("envProcess", ""), "envVars": d.get("envVars") or {},
            "labels": d.get("labels") or {}, "annotations": d.get("annotations") or {},
            "invocationCount": fn.invocations, "replicas": fn.desired,
            "availableReplicas": len(fn.ready()), "createdAt": fn.created_at,
        }
        for key in ("limits", "requests", "constraints", "secrets"):
            if d.get(key) is not None:
                out[key] = d[key]
        return out

    # -- background work -----------------------------------------------------------------------

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(
            total=self.settings.data.request_timeout_s + 10))
        self._reconciler = asyncio.create_task(self._reconcile_forever())

    async def _reconcile_forever(self) -> None:
        await every(0.2, self._reconcile, log, "reconciler")

    async def _reconcile(self) -> None:
        for fn in list(self.functions.values()) + self._draining:
            reaped = self.processes.refresh(fn)
            if reaped and fn.stage is not None:
                await asyncio.to_thread(self._deregister, fn, reaped)
            await self._probe(fn)
        self._draining = [fn for fn in self._draining if fn.replicas]
        await asyncio.to_thread(self.activator.publish)
        self.converge()
        self._save_state()
        if self.settings.containers.run and time.monotonic() >= self._cpus_checked + CPUS_CHECK_S:
            self._cpus_checked = time.monotonic()
            await asyncio.to_thread(self._apply_cpus)

    def _deregister(self, fn: FunctionState, reaped: list[ReplicaProcess]) -> None:
        """Takes replicas that exited out of the registry, as Kubernetes takes a dead pod out of
        its endpoints once the kubelet reports it: an entry waiting on a step such a replica held
        prefills again at its next liveness check, not once the registration expires
        (QUART_REPLICA_TTL_S, which stays for replicas whose server is gone). A replica that
        drained has deregistered itself; one in a container registers the pid it has there, and
        is left to expire. One that exited unasked is recorded (`Placer.exited`)."""
        gone, stage = {(r.server, r.pid) for r in reaped}, fn.stage
        try:
            self.placer.exited(fn, reaped)
            for record in self.placer.store.live_replicas(stage.model, stage.first):
                if (record.server, record.pid) in gone:
                    self.placer.store.deregister(record)
                    log.info("%s exited: taken out of the registry", record.replica_id)
        except Unavailable as exc:  # Redis down: the registrations expire on their own
            log.info("could not deregister the replicas that exited (%s); they expire", exc)

    def _apply_cpus(self) -> None:
        """Replicas in containers get the CPU quota the compensator set for their stage."""
        for fn in list(self.functions.values()):
            wanted = self.placer.store.stage_cpus(fn.stage) if fn.stage is not None else None
            if wanted is not None:
                self.processes.set_cpus(fn, wanted)

    # -- what a provider started in this one's place adopts ------------------------------------

    def _save_state(self) -> None:
        state = {"components": self.supervisor.snapshot() if self.supervisor else {},
                 "functions": [fn.snapshot() for fn in self.functions.values()]}
        if state != self._saved:
            save_state(state_path(self.settings.home), state)
            self._saved = state

    def adopt(self, functions: list[dict]) -> None:
        """The functions a provider that died left (runtime/state_file.py), with their replicas
        that still run; a function whose image this stack no longer has is dropped."""
        for saved in functions:
            deployment = saved["deployment"]
            if deployment.get("image") not in self.handlers:
                log.warning("not adopting %s: image %s is not in the stack", deployment.get("service"),
                            deployment.get("image"))
                continue
            fn = FunctionState.restore(saved, self.handlers[deployment["image"]])
            self.functions[fn.name] = fn
            log.info("adopted %s: %d of %d replicas still run", fn.name, len(fn.replicas), fn.desired)
        self.converge()

    async def _probe(self, fn: FunctionState) -> None:
        """Health checks: starting replicas every tick, ready ones every PROBE_PERIOD_S."""
        now = time.monotonic()
        for replica in fn.serving():
            if replica.port is None or (replica.ready and now - replica.probed_at < PROBE_PERIOD_S):
                continue
            replica.probed_at = now
            try:
                async with self._session.get(f"http://127.0.0.1:{replica.port}/_/health",
                                             timeout=aiohttp.ClientTimeout(total=2)) as resp:
                    healthy = resp.status == 200
            except (TimeoutError, aiohttp.ClientError):
                healthy = False
            # Like a Kubernetes readiness probe: one slow answer on a busy machine does not take
            # a ready replica out of service; FAILURE_THRESHOLD in a row do.
            replica.failed_probes = 0 if healthy else replica.failed_probes + 1
            if healthy and not replica.ready and replica.placement is not None:
                await asyncio.to_thread(self.placer.started, fn, replica)
            if healthy:
                replica.ready = True
            elif not replica.ready or replica.failed_probes >= FAILURE_THRESHOLD:
                replica.ready = False

    async def stop(self) -> None:
        if self._reconciler:
            self._reconciler.cancel()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.processes.stop_all,
                                   list(self.functions.values()) + self._draining,
                                   self.settings.data.drain_timeout_s)
        if self._session:
            await self._session.close()

    # -- HTTP ----------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(middlewares=[json_errors, self._auth], client_max_size=self.settings.limits.max_body_bytes + 1)
        r = app.router
        r.add_get("/healthz", self._healthz)
        r.add_get("/metrics", self._metrics)
        r.add_get("/system/info", self._info)
        r.add_get("/system/functions", self._list)
        r.add_post("/system/functions", self._deploy)
        r.add_put("/system/functions", self._update)
        r.add_delete("/system/functions", self._delete)
        r.add_get("/system/function/{name}", self._get)
        r.add_post("/system/scale-function/{name}", self._scale)
        r.add_get("/system/logs", self._logs)
        r.add_get("/system/namespaces", lambda _: web.json_response([self.settings.gateway.namespace]))
        r.add_get("/v1/models", self._v1_models)
        r.add_route("*", "/v1/{tail:.*}", self._v1_invoke)
        r.add_route("*", "/function/{name}", self._invoke)
        r.add_route("*", "/function/{name}/{tail:.*}", self._invoke)
        app.on_startup.append(lambda _: self.start())
        app.on_shutdown.append(lambda _: self.stop())
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler) -> web.StreamResponse:
        if request.path.startswith("/system/") and not self._authorized(request):
            return web.json_response({"error": "unauthorized: /system/* needs basic auth"}, status=401,
                                     headers={"WWW-Authenticate": 'Basic realm="Restricted"'})
        return await handler(request)

    def _authorized(self, request: web.Request) -> bool:
        scheme, _, value = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            user, _, password = base64.b64decode(value, validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return False
        expected = f"{self.settings.gateway.user}:{self.password}".encode()
        return hmac.compare_digest(f"{user}:{password}".encode(), expected)

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), content_type="text/plain")

    async def _info(self, _: web.Request) -> web.Response:
        version = {"sha": "local", "release": VERSION}
        return web.json_response({
            "provider": {"provider": "quart-local", "orchestration": "processes", "version": version},
            "version": version, "arch": platform.machine()})

    async def _healthz(self, _: web.Request) -> web.Response:
        """200 while every supervised component runs; 503 naming those being started again."""
        components = self.supervisor.status() if self.supervisor else {}
        if self.restarts is not None:
            components = {"provider": {"running": True, **self.restarts}, **components}
        down = sorted(name for name, c in components.items() if not c["running"])
        if not down:
            return web.json_response({"status": "ok", "components": components})
        return web.json_response({"error": f"restarting: {', '.join(down)}", "components": components}, status=503)

    async def _list(self, _: web.Request) -> web.Response:
        return web.json_response([self.status(fn) for fn in self.functions.values()])

    async def _get(self, request: web.Request) -> web.Response:
        fn = self.functions.get(request.match_info["name"])
        if fn is None:
            return error(404, f"function {request.match_info['name']!r} not found")
        return web.json_response(self.status(fn))

    async def _logs(self, request: web.Request) -> web.StreamResponse:
        try:
            query = LogQuery.parse(request.query)
        except BadRequest as exc:
            return error(400, str(exc))
        if self._function(query.name, request.query.get("namespace", "")) is None:
            return error(404, f"function {query.name!r} not found")
        return await stream_logs(request, query, self.processes.log_dir / f"{query.name}.log",
                                 self.settings.gateway.namespace, self.settings.data.request_timeout_s)

    async def _body(self, request: web.Request) -> object:
        try:
            return load_json(await request.read())
        except BadRequest as exc:
            raise BadDeployment(str(exc)) from None

    async def _deploy(self, request: web.Request) -> web.Response:
        try:
            self.deploy(await self._body(request))
        except BadDeployment as exc:
            return error(400, str(exc))
        return web.Response(status=202)

    async def _update(self, request: web.Request) -> web.Response:
        try:
            self.deploy(await self._body(request), update=True)
        except BadDeployment as exc:
            return error(400, str(exc))
        except KeyError as exc:
            return error(404, f"function {exc.args[0]!r} not found")
        return web.Response(status=200)

    async def _delete(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request)
        except BadDeployment as exc:
            return error(400, str(exc))
        name = body.get("functionName") if isinstance(body, dict) else None
        if not isinstance(name, str):
            return error(400, "'functionName' is required and must be a string")
        if name not in self.functions:
            return error(404, f"function {name!r} not found")
        self.delete(name)
        return web.Response(status=200)

    async def _scale(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in self.functions:
            return error(404, f"function {name!r} not found")
        try:
            body = await self._body(request)
            replicas = body.get("replicas") if isinstance(body, dict) else None
            if not isinstance(replicas, int) or isinstance(replicas, bool):
                raise BadDeployment("'replicas' is required and must be an integer")
            self.scale(name, replicas)
        except BadDeployment as exc:
            return error(400, str(exc))
        return web.Response(status=202)

    def _function(self, name: str, namespace: str) -> FunctionState | None:
        """The function of that name, where the namespace is this runtime's (or left out)."""
        return self.functions.get(name) if namespace in ("", self.settings.gateway.namespace) else None

    async def _invoke(self, request: web.Request) -> web.StreamResponse:
        fn = self._function(*request.match_info["name"].partition(".")[::2])
        if fn is None:
            return error(404, f"function {request.match_info['name']!r} not found")
        return await self._call(fn, request, request.match_info.get("tail", ""), await request.read())

    # -- one OpenAI base URL for every model: /v1 routes on the body's `model` ------------------

    def _entries(self) -> dict[str, FunctionState]:
        """Each model's entry function (the one without stages)."""
        return {model: fn for fn in self.functions.values() if fn.stage is None
                and (model := identity(fn.deployment)[0])}

    async def _v1_models(self, request: web.Request) -> web.Response:
        cards = []
        for model, fn in sorted(self._entries().items()):
            try:
                context = Manifest.load(self.settings.model_dir(model)).context_length
            except (FileNotFoundError, KeyError, ValueError):
                context = None  # an emulated model has no manifest
            created = datetime.fromisoformat(fn.created_at).timestamp()
            cards.append({"id": model, "object": "model", "created": int(created), "owned_by": "quart",
                          "max_model_len": context})
        return web.json_response({"object": "list", "data": cards})

    async def _v1_invoke(self, request: web.Request) -> web.StreamResponse:
        tail = request.match_info["tail"]
        if request.method != "POST":
            return web.json_response(error_body(f"/v1/{tail} takes POST, or is GET /v1/models", 405), status=405)
        body = await request.read()
        try:
            model = load_json(body).get("model")
        except (BadRequest, AttributeError) as exc:
            return web.json_response(error_body(f"the body must be a JSON object: {exc}", 400), status=400)
        entries = self._entries()
        if not isinstance(model, str) or model not in entries:
            return web.json_response(error_body(f"the model {model!r} does not exist; served here: {sorted(entries)}",
                                                404, "model", "model_not_found"), status=404)
        return await self._call(entries[model], request, f"v1/{tail}", body)

    async def _call(self, fn: FunctionState, request: web.Request, tail: str, body: bytes) -> web.StreamResponse:
        name = fn.name
        started = time.time()
        model = identity(fn.deployment)[0]
        self.activator.started(model)
        try:
            if self.activator.wake(list(self.functions.values()), fn, started):
                self.converge()  # the woken replicas start now; _forward holds the request meanwhile
            response = await self._forward(fn, request, tail, body)
        finally:
            self.activator.finished(model)
        fn.invocations += 1
        code = str(response.status)
        self.invocations.labels(name, code).inc()
        self.seconds.labels(name, code).observe(time.time() - started)
        return response

    async def _forward(self, fn: FunctionState, request: web.Request, tail: str, body: bytes) -> web.StreamResponse:
        headers = _forwarded(request.headers)
        # A replica that refuses the connection or drops it before answering (it just died) is
        # skipped for the next one, waiting for a replacement if it was the only one: nothing was
        # answered yet, so the request is not answered twice.
        deadline = time.monotonic() + self.settings.data.request_timeout_s
        while True:
            replica = fn.pick()
            if replica is None:
                if fn.desired == 0 or time.monotonic() > deadline:
                    return error(503, f"function {fn.name!r} has no ready replica")
                await asyncio.sleep(0.2)
                continue
            url = f"http://127.0.0.1:{replica.port}/{tail}"
            try:
                async with self._session.request(request.method, url, data=body, headers=headers,
                                                 params=request.query) as resp:
                    out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_HEADERS}
                    if resp.content_type == "text/event-stream":
                        return await _relay_stream(request, resp, out_headers)
                    payload = await resp.read()
                    return web.Response(status=resp.status, body=payload, headers=out_headers)
            except aiohttp.ClientConnectionError:
                replica.ready = False
            except TimeoutError:
                return error(504, f"function {fn.name!r} did not answer in time")


async def _relay_stream(request: web.Request, resp: aiohttp.ClientResponse, headers: dict) -> web.StreamResponse:
    """Server-sent events passed on as they arrive (a gateway that buffered them would not stream)."""
    out = web.StreamResponse(status=resp.status, headers=headers)
    await out.prepare(request)
    try:
        async for chunk in resp.content.iter_any():
            await out.write(chunk)
    except aiohttp.ClientConnectionError as exc:
        # The replica died mid-stream: what was sent cannot be taken back; the stream just ends.
        log.warning("stream from a replica broke off: %s", exc)
        return out
    await out.write_eof()
    return out
