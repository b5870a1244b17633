"""Every HTTP server of the project answers an error as a JSON object naming the problem, as its
handlers do, also where aiohttp itself refuses a request (no such route, a method the route does
not take, a body over the size limit), and where a handler fails on what it did not foresee."""
from __future__ import annotations

import logging

from aiohttp import web

log = logging.getLogger("quart.http")

# What aiohttp sets on its own errors and must not be repeated on a new response.
_DROPPED = {"content-type", "content-length"}


@web.middleware
async def json_errors(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers = {k: v for k, v in exc.headers.items() if k.lower() not in _DROPPED}
        return web.json_response({"error": f"{exc.reason}: {request.method} {request.path}"
                                  if exc.text == f"{exc.status}: {exc.reason}" else exc.text},
                                 status=exc.status, headers=headers)
    except Exception as exc:  # noqa: BLE001 - a bug is a logged JSON 500, and the server lives on
        log.exception("%s %s failed", request.method, request.path)
        return web.json_response({"error": f"internal error: {type(exc).__name__}"}, status=500)
