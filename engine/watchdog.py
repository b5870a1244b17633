"""Runs one function replica: serves a handler of OpenFaaS's python3-http template shape,
`handle(event, context)` returning {"statusCode", "body", "headers"}, over HTTP, like the
template's watchdog does. It also answers the watchdog's health path and Prometheus metrics.

    python -m engine.watchdog --handler functions/stage --port-file /tmp/p
    python -m engine.watchdog --handler /home/app/function --host 0.0.0.0 --port 8080   (an image)

It listens at once and loads the handler after, as Kubernetes probes want of a replica that takes
a while to load (torch, a shard): /_/live answers 200 from the start (liveness), /_/health and
/_/ready 200 only once the handler is loaded and its `ready()` hook says so (readiness); an
invocation that arrives while it loads waits for the load. of-watchdog's settings are honoured
from their own variables: `read_timeout` (the body), `exec_timeout` (the handler's answer: 504
after), `write_timeout` (the whole response, a stream included), `max_inflight` (invocations at
once: 429 beyond); durations as Go writes them ("30s", "1m30s") or in seconds.

Optional handler hooks: `ready()` (health), `shutdown()` (called on SIGTERM before exiting,
so a replica being scaled down finishes its work first).

Beyond the template: a body that is an async iterator of bytes is streamed as it is produced (as
of-watchdog's HTTP mode streams), and a client that goes away cancels its request's handler.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import inspect
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from contracts import logs as log_format
from contracts.config import Settings, load_settings
from contracts.http_errors import json_errors
from contracts.stack import parse_duration

HEALTH_PATH, READY_PATH, LIVE_PATH = "/_/health", "/_/ready", "/_/live"
METRICS_PATH = "/metrics"
STREAM = "quart.stream"   # the request's streamed response, once it has begun
log = logging.getLogger("quart.watchdog")


class Event:
    """What python3-http's handler receives."""

    def __init__(self, request: web.Request, body: bytes) -> None:
        self.body = body
        self.headers = request.headers
        self.method = request.method
        self.query = request.query
        self.path = request.path


class Context:
    def __init__(self) -> None:
        self.hostname = socket.gethostname()


def duration_s(text: str) -> float:
    """A Go duration ("30s", "1m30s", "500ms") or a number of seconds, as of-watchdog reads them."""
    try:
        return float(text)
    except ValueError:
        return parse_duration(text)


@dataclass(frozen=True)
class Limits:
    """What bounds one replica's HTTP serving: of-watchdog's variables where the function's
    environment sets them, else the runtime's configuration (0: no bound)."""
    max_body: int
    read_timeout_s: float = 30.0
    exec_timeout_s: float = 0.0
    write_timeout_s: float = 0.0
    max_inflight: int = 0

    @classmethod
    def from_environment(cls, settings: Settings, env: Mapping[str, str]) -> Limits:
        """ValueError naming a malformed variable."""
        def seconds(name: str, default: float) -> float:
            try:
                return duration_s(env[name]) if env.get(name) else default
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
        raw = env.get("max_inflight") or "0"
        if not raw.isdigit():
            raise ValueError(f"max_inflight: {raw!r} is not a whole number")
        return cls(settings.limits.max_body_bytes, seconds("read_timeout", settings.limits.read_timeout_s),
                   seconds("exec_timeout", 0.0), seconds("write_timeout", 0.0), int(raw))


class HandlerSlot:
    """The handler, once loaded: the app serves its health paths before."""

    def __init__(self, handler: ModuleType | None = None) -> None:
        self.handler: ModuleType | None = None
        self.is_async = False
        self.loaded = asyncio.Event()
        if handler is not None:
            self.fill(handler)

    def fill(self, handler: ModuleType) -> None:
        self.handler, self.is_async = handler, inspect.iscoroutinefunction(handler.handle)
        self.loaded.set()

    def ready(self) -> bool:
        return self.handler is not None and getattr(self.handler, "ready", lambda: True)()


def load_handler(folder: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"handler_{folder.name}", folder / "handler.py")
    if spec is None or spec.loader is None:
        raise SystemExit(f"no handler.py in {folder}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def _respond(request: web.Request, result: object) -> web.StreamResponse:
    if not isinstance(result, dict):
        result = {"body": result}
    body = result.get("body", b"")
    if not hasattr(body, "__aiter__"):
        return _response(result)
    response = web.StreamResponse(status=int(result.get("statusCode", 200)), headers=dict(result.get("headers") or {}))
    request[STREAM] = response
    try:
        await response.prepare(request)
        async for chunk in body:
            await response.write(chunk)
        await response.write_eof()
    finally:
        await body.aclose()  # a client gone mid-stream: the producer cleans up now
    return response


def _response(result: dict) -> web.Response:
    status = int(result.get("statusCode", 200))
    headers = dict(result.get("headers") or {})
    body = result.get("body", b"")
    if isinstance(body, (dict, list)):
        body = json.dumps(body).encode()
        headers.setdefault("Content-Type", "application/json")
    elif isinstance(body, str):
        body = body.encode()
    return web.Response(status=status, body=body, headers=headers)


def build_app(slot: HandlerSlot, limits: Limits) -> web.Application:
    inflight = 0

    async def readiness(_: web.Request) -> web.Response:
        ready = slot.ready()
        return web.Response(status=200 if ready else 503, text="OK" if ready else "starting")

    async def live(_: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def invoke(request: web.Request) -> web.StreamResponse:
        nonlocal inflight
        if limits.max_inflight and inflight >= limits.max_inflight:
            return web.json_response({"error": f"this replica is at its max_inflight ({limits.max_inflight})"}, status=429)
        inflight += 1
        try:
            async with asyncio.timeout(limits.write_timeout_s or None):
                return await _invoke(request)
        except TimeoutError:
            if STREAM in request:   # a stream under way cannot change its status: it ends here
                return request[STREAM]
            return web.json_response({"error": f"no answer within write_timeout ({limits.write_timeout_s:g} s)"}, status=504)
        finally:
            inflight -= 1

    async def _invoke(request: web.Request) -> web.StreamResponse:
        if request.content_length is not None and request.content_length > limits.max_body:
            return _too_large(limits.max_body)
        try:
            body = await asyncio.wait_for(_read_body(request, limits.max_body), limits.read_timeout_s)
        except TimeoutError:
            return web.json_response({"error": f"the request body did not arrive within {limits.read_timeout_s:g} s"},
                                     status=408)
        if body is None:
            return _too_large(limits.max_body)
        try:
            async with asyncio.timeout(limits.exec_timeout_s or None):
                await slot.loaded.wait()   # an invocation during the load waits for it
                result = await _call(slot, Event(request, body), Context())
        except TimeoutError:
            return web.json_response({"error": f"the function did not answer within exec_timeout "
                                               f"({limits.exec_timeout_s:g} s)"}, status=504)
        return await _respond(request, result)

    app = web.Application(middlewares=[json_errors], client_max_size=limits.max_body + 1)
    app.router.add_get(HEALTH_PATH, readiness)
    app.router.add_get(READY_PATH, readiness)
    app.router.add_get(LIVE_PATH, live)
    app.router.add_get(METRICS_PATH, metrics)
    app.router.add_route("*", "/{tail:.*}", invoke)
    return app


async def _call(slot: HandlerSlot, event: Event, context: Context) -> object:
    """The handler's result; a handler's bug is a JSON 500 (json_errors), and the replica lives on."""
    if slot.is_async:
        return await slot.handler.handle(event, context)
    return await asyncio.get_running_loop().run_in_executor(None, slot.handler.handle, event, context)


async def _read_body(request: web.Request, max_body: int) -> bytes | None:
    """The whole body however it arrives (in pieces, chunked); None past `max_body` bytes."""
    chunks, size = [], 0
    while chunk := await request.content.read(1 << 16):
        size += len(chunk)
        if size > max_body:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> web.Response:
    return web.json_response({"error": f"body larger than {limit} bytes"}, status=413)


async def serve(folder: Path, host: str, port_file: Path | None, limits: Limits, port: int = 0) -> None:
    """Listens, then loads the handler in `folder` (a handler that fails to load ends the process
    with its error, as before it listened), then serves until SIGTERM and drains."""
    slot = HandlerSlot()
    runner = web.AppRunner(build_app(slot, limits), access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    if port_file is not None:
        # Written last and atomically: its presence tells the provider the replica is listening
        # (ready once /_/health says so).
        tmp = port_file.with_suffix(".tmp")
        tmp.write_text(str(port))
        tmp.rename(port_file)
    log.info("listening on %s:%d; loading %s", host, port, folder)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    slot.fill(await loop.run_in_executor(None, load_handler, folder))
    log.info("handler loaded")
    await stop.wait()
    # Drain first (the handler finishes the work in hand), then stop answering HTTP.
    shutdown = getattr(slot.handler, "shutdown", None)
    if shutdown is not None:
        await loop.run_in_executor(None, shutdown)
    await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--handler", type=Path, required=True, help="folder holding handler.py")
    parser.add_argument("--port-file", type=Path, help="file to write the listening port to")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (default: any free one)")
    args = parser.parse_args(argv)
    settings = load_settings()
    log_format.configure(settings.log_level, settings.log_format)
    try:
        limits = Limits.from_environment(settings, os.environ)
    except ValueError as exc:
        raise SystemExit(f"watchdog: {exc}") from None
    for name, bound in (("exec_timeout", limits.exec_timeout_s), ("write_timeout", limits.write_timeout_s)):
        if 0 < bound < settings.data.request_timeout_s:
            log.warning("%s (%g s) is shorter than QUART_REQUEST_TIMEOUT_S (%g s): a request still running then gets "
                        "the watchdog's 504, not the function's", name, bound, settings.data.request_timeout_s)
    asyncio.run(serve(args.handler.resolve(), args.host, args.port_file, limits, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
