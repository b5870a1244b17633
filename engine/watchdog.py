"""Runs one function replica: serves a handler of OpenFaaS's python3-http template shape,
`handle(event, context)` returning {"statusCode", "body", "headers"}, over HTTP, like the
template's watchdog does. It also answers the watchdog's health path and Prometheus metrics.

    python -m engine.watchdog --handler functions/stage --port-file /tmp/p
    python -m engine.watchdog --handler /home/app/function --host 0.0.0.0 --port 8080   (an image)

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
from pathlib import Path
from types import ModuleType

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from contracts import logs as log_format
from contracts.config import load_settings
from contracts.http_errors import json_errors

HEALTH_PATH = "/_/health"
METRICS_PATH = "/metrics"
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


def build_app(handler: ModuleType, max_body: int, read_timeout_s: float = 30.0) -> web.Application:
    is_async = inspect.iscoroutinefunction(handler.handle)

    async def health(_: web.Request) -> web.Response:
        ready = getattr(handler, "ready", lambda: True)()
        return web.Response(status=200 if ready else 503, text="OK" if ready else "starting")

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def invoke(request: web.Request) -> web.StreamResponse:
        if request.content_length is not None and request.content_length > max_body:
            return _too_large(max_body)
        try:
            body = await asyncio.wait_for(_read_body(request, max_body), read_timeout_s)
        except TimeoutError:
            return web.json_response({"error": f"the request body did not arrive within {read_timeout_s:g} s"},
                                     status=408)
        if body is None:
            return _too_large(max_body)
        event, context = Event(request, body), Context()
        # A handler's bug is a JSON 500 (json_errors), and the replica lives on.
        if is_async:
            result = await handler.handle(event, context)
        else:
            result = await asyncio.get_running_loop().run_in_executor(None, handler.handle, event, context)
        return await _respond(request, result)

    app = web.Application(middlewares=[json_errors], client_max_size=max_body + 1)
    app.router.add_get(HEALTH_PATH, health)
    app.router.add_get(METRICS_PATH, metrics)
    app.router.add_route("*", "/{tail:.*}", invoke)
    return app


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


async def serve(handler: ModuleType, host: str, port_file: Path | None, max_body: int,
                read_timeout_s: float = 30.0, port: int = 0) -> None:
    runner = web.AppRunner(build_app(handler, max_body, read_timeout_s), access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    if port_file is not None:
        # Written last and atomically: its presence tells the provider the replica is listening.
        tmp = port_file.with_suffix(".tmp")
        tmp.write_text(str(port))
        tmp.rename(port_file)
    log.info("listening on %s:%d", host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    # Drain first (the handler finishes the work in hand), then stop answering HTTP.
    shutdown = getattr(handler, "shutdown", None)
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
    log_format.configure(os.environ.get("QUART_LOG_LEVEL", "INFO"))
    settings = load_settings()
    handler = load_handler(args.handler.resolve())
    asyncio.run(serve(handler, args.host, args.port_file, settings.limits.max_body_bytes,
                      settings.limits.read_timeout_s, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
