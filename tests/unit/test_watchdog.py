"""The function watchdog over real HTTP on a real socket: a body that arrives in pieces is read
whole, one that never finishes gets 408, one over the limit 413, and a handler that raises a JSON
500 while the watchdog keeps serving."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from aiohttp import web

from engine.watchdog import build_app


def _handler(event, context):
    if event.body == b"boom":
        raise RuntimeError("a bug")
    return {"statusCode": 200, "body": {"bytes": len(event.body)}}


async def _serve(max_body: int, read_timeout_s: float) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(build_app(SimpleNamespace(handle=_handler), max_body, read_timeout_s))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


async def _post(port: int, declared: int, pieces: list[bytes], pause_s: float = 0.0) -> tuple[int, dict]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: {declared}\r\nConnection: close\r\n\r\n".encode())
    for piece in pieces:
        writer.write(piece)
        await writer.drain()
        await asyncio.sleep(pause_s)
    # The answer by its length: after a 408 the connection may stay open for the body's rest.
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    body = await asyncio.wait_for(reader.readexactly(length), 10)
    writer.close()
    return int(head.split()[1]), json.loads(body)


def test_bodies_in_pieces_timeouts_limits_and_handler_errors():
    async def main() -> None:
        runner, port = await _serve(max_body=1_000_000, read_timeout_s=1.0)
        try:
            pieces = [b"x" * 10_000] * 50
            assert await _post(port, 500_000, pieces, pause_s=0.002) == (200, {"bytes": 500_000})
            status, body = await _post(port, 100, [b"only ten.."])
            assert status == 408 and "did not arrive" in body["error"]
            status, body = await _post(port, 2_000_000, [b"x" * 1000])
            assert status == 413 and "larger than" in body["error"]
            status, body = await _post(port, 4, [b"boom"])
            assert status == 500 and body == {"error": "internal error: RuntimeError"}
            assert await _post(port, 3, [b"abc"]) == (200, {"bytes": 3})
        finally:
            await runner.cleanup()
    asyncio.run(main())
