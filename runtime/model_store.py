"""A model store: serves partitioned models the way a KeysManager does (`GET /models/{model}`, the
listing `models.fetch.ensure_manifest` reads, and `GET /models/{model}/{path}`) through one paced
link, every connection's bytes sharing --bandwidth in the order they ask, as remote storage
behind one network link does (HydraServe's testbed: 16 Gbps a server). The embedded runtime runs
one for its virtual servers with QUART_VIRTUAL_DISKS (runtime/server.py), so that a cold start
fetches its shard at the store's pace and peers (λScale's multicast) have a reason to exist; the
cold-start benchmark runs one per emulated server. With --auth every path but /healthz needs the
runtime's internal token (`Authorization: Bearer ...`, QUART_INTERNAL_TOKEN or <QUART_HOME>/internal-token).

    python -m runtime.model_store --models DIR --port 9000 --bandwidth 2.5e8 [--auth]
"""
from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from aiohttp import web

from contracts import logs as log_format
from contracts.config import load_settings
from contracts.secrets import bearer_ok
from keysmanager.pacing import Link
from models.fetch import served_file, served_files

log = logging.getLogger("quart.store")
CHUNK = 1 << 20


def build_app(models: Path, bandwidth: float, token: str = "") -> web.Application:
    """The store's routes over `models` (a folder of partitioned models), paced at `bandwidth`
    bytes/s; `token`: what every request but /healthz must carry (empty: none)."""
    link = Link(bandwidth)

    def model_dir(request: web.Request) -> Path:
        model = request.match_info["model"]
        directory = (models / model).resolve()
        if directory.parent != models.resolve() or not directory.is_dir():  # no "..", no link out
            raise web.HTTPNotFound(text=f"no model {model!r} in this store", content_type="text/plain")
        return directory

    async def files(request: web.Request) -> web.Response:
        return web.json_response(served_files(model_dir(request)))

    async def file(request: web.Request) -> web.StreamResponse:
        path = served_file(model_dir(request), request.match_info["path"])
        if path is None:
            raise web.HTTPNotFound(text="no such file", content_type="text/plain")
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        response.content_length = path.stat().st_size
        await response.prepare(request)
        started = time.monotonic()
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                await link.send(len(chunk))
                await response.write(chunk)
        await response.write_eof()
        log.info("sent %s/%s (%d bytes) in %.2f s", request.match_info["model"], request.match_info["path"],
                 response.content_length, time.monotonic() - started)
        return response

    @web.middleware
    async def auth(request: web.Request, handler) -> web.StreamResponse:
        if token and request.path != "/healthz" and not bearer_ok(request.headers.get("Authorization"), token):
            return web.json_response({"error": "unauthorized: the model store needs the internal token"}, status=401)
        return await handler(request)

    app = web.Application(middlewares=[auth])
    app.router.add_get("/models/{model}", files)
    app.router.add_get("/models/{model}/{path:.+}", file)
    app.router.add_get("/healthz", lambda _: web.Response(text="OK"))
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=Path, required=True, help="the folder of partitioned models served")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--bandwidth", type=float, required=True, help="bytes/s of the store's link")
    parser.add_argument("--auth", action="store_true", help="every request must carry the runtime's internal token")
    args = parser.parse_args()
    settings = load_settings()
    log_format.configure(settings.log_level, settings.log_format)
    token = settings.internal_api_token() if args.auth else ""
    web.run_app(build_app(args.models, args.bandwidth, token), host=args.host, port=args.port, print=None,
                access_log=None)


if __name__ == "__main__":
    main()
