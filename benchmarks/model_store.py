"""A model store for the cold-start benchmark: serves partitioned models the way a KeysManager
does (`GET /models/{model}`, `GET /models/{model}/{path}`) through one paced link: every
connection's bytes share --bandwidth, first come first served, as one server's network link to
remote storage does (HydraServe's testbed: 16 Gbps per server). The benchmark runs one store per
emulated server, so a cold start spread over s servers gets s links, as it would on s machines.

    python -m benchmarks.model_store --models DIR --port 9000 --bandwidth 2.5e8
"""
from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from aiohttp import web

from models.fetch import served_file, served_files

CHUNK = 1 << 20


class Link:
    """One link's time: each chunk takes len/bandwidth of it, after the chunks before it."""

    def __init__(self, bandwidth: float) -> None:
        self.bandwidth, self.free_at = bandwidth, 0.0

    async def send(self, n: int) -> None:
        now = time.monotonic()
        self.free_at = max(now, self.free_at) + n / self.bandwidth
        await asyncio.sleep(self.free_at - now)


def build_app(models: Path, bandwidth: float) -> web.Application:
    link = Link(bandwidth)

    def model_dir(request: web.Request) -> Path:
        directory = (models / request.match_info["model"]).resolve()
        if directory.parent != models.resolve() or not directory.is_dir():
            raise web.HTTPNotFound(text="no such model")
        return directory

    async def files(request: web.Request) -> web.Response:
        return web.json_response(served_files(model_dir(request)))

    async def file(request: web.Request) -> web.StreamResponse:
        path = served_file(model_dir(request), request.match_info["path"])
        if path is None:
            raise web.HTTPNotFound(text="no such file")
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        response.content_length = path.stat().st_size
        await response.prepare(request)
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                await link.send(len(chunk))
                await response.write(chunk)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/models/{model}", files)
    app.router.add_get("/models/{model}/{path:.+}", file)
    app.router.add_get("/healthz", lambda _: web.Response(text="OK"))
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=Path, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--bandwidth", type=float, required=True, help="bytes/s of the link")
    args = parser.parse_args()
    web.run_app(build_app(args.models, args.bandwidth), host="127.0.0.1", port=args.port, print=None,
                access_log=None)


if __name__ == "__main__":
    main()
