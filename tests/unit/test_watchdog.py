"""The function watchdog over real HTTP on a real socket: a body that arrives in pieces is read
whole, one that never finishes gets 408, one over the limit 413, and a handler that raises a JSON
500 while the watchdog keeps serving; liveness before the handler is loaded and readiness after;
of-watchdog's exec_timeout, write_timeout and max_inflight."""
from __future__ import annotations

import asyncio
import json
import urllib.request
from types import SimpleNamespace

import pytest
from aiohttp import web

from contracts.config import Settings
from engine.watchdog import HandlerSlot, Limits, build_app, duration_s


def _handler(event, context):
    if event.body == b"boom":
        raise RuntimeError("a bug")
    return {"statusCode": 200, "body": {"bytes": len(event.body)}}


async def _serve(max_body: int = 1_000_000, read_timeout_s: float = 5.0, slot: HandlerSlot | None = None,
                 **limits: float) -> tuple[web.AppRunner, int]:
    slot = slot or HandlerSlot(SimpleNamespace(handle=_handler))
    runner = web.AppRunner(build_app(slot, Limits(max_body, read_timeout_s, **limits)))
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


async def _get(port: int, path: str) -> int:
    def get() -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as reply:
                return reply.status
        except urllib.error.HTTPError as exc:
            return exc.code
    return await asyncio.to_thread(get)


def test_live_while_loading_ready_after_and_an_invocation_waits_for_the_load():
    async def main() -> None:
        slot = HandlerSlot()
        runner, port = await _serve(slot=slot)
        try:
            assert [await _get(port, p) for p in ("/_/live", "/_/health", "/_/ready")] == [200, 503, 503]
            waiting = asyncio.create_task(_post(port, 3, [b"abc"]))
            await asyncio.sleep(0.3)
            assert not waiting.done()
            slot.fill(SimpleNamespace(handle=_handler, ready=lambda: True))
            assert await asyncio.wait_for(waiting, 10) == (200, {"bytes": 3})
            assert [await _get(port, p) for p in ("/_/live", "/_/health", "/_/ready")] == [200, 200, 200]
        finally:
            await runner.cleanup()
    asyncio.run(main())


async def _slow(event, context):
    await asyncio.sleep(float(event.body or 0))
    return {"statusCode": 200, "body": {"slept": float(event.body or 0)}}


def test_exec_timeout_write_timeout_and_max_inflight():
    async def main() -> None:
        slot = HandlerSlot(SimpleNamespace(handle=_slow))
        runner, port = await _serve(slot=slot, exec_timeout_s=0.5, max_inflight=1)
        try:
            status, body = await _post(port, 1, [b"2"])
            assert status == 504 and "exec_timeout" in body["error"]
            busy = asyncio.create_task(_post(port, 3, [b"0.4"]))
            await asyncio.sleep(0.1)
            status, body = await _post(port, 1, [b"0"])
            assert status == 429 and "max_inflight" in body["error"]
            assert await busy == (200, {"slept": 0.4})
            assert await _post(port, 1, [b"0"]) == (200, {"slept": 0.0})
        finally:
            await runner.cleanup()
        runner, port = await _serve(slot=slot, write_timeout_s=0.5)
        try:
            status, body = await _post(port, 1, [b"2"])
            assert status == 504 and "write_timeout" in body["error"]
        finally:
            await runner.cleanup()
    asyncio.run(main())


def test_of_watchdog_variables_are_read_as_it_reads_them():
    assert [duration_s(x) for x in ("30s", "1m30s", "500ms", "2h", "45", "2.5")] == [30, 90, 0.5, 7200, 45, 2.5]
    for bad in ("30 s", "soon", "1d", ""):
        with pytest.raises(ValueError):
            duration_s(bad)
    settings = Settings()
    limits = Limits.from_environment(settings, {"exec_timeout": "2m", "write_timeout": "125s", "read_timeout": "10s",
                                                "max_inflight": "4"})
    assert (limits.exec_timeout_s, limits.write_timeout_s, limits.read_timeout_s, limits.max_inflight) == (120, 125, 10, 4)
    assert Limits.from_environment(settings, {}) == Limits(settings.limits.max_body_bytes, settings.limits.read_timeout_s)
    for env, name in (({"exec_timeout": "later"}, "exec_timeout"), ({"max_inflight": "-1"}, "max_inflight")):
        with pytest.raises(ValueError, match=name):
            Limits.from_environment(settings, env)
