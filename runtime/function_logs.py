"""GET /system/logs of the embedded gateway, as OpenFaaS's gateway answers it (`faas-cli logs`): a
function's log lines as newline-delimited LogEntry records, the last `tail` of them, those after
`since`, of one `instance` (a replica's process id), and with `follow` those written after, until
the request timeout or the client leaves. Every replica of a function appends to one file,
<home>/logs/<function>.log (rotated copies are not read)."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from aiohttp import web

from contracts.logs import LogEntry, LogReader
from contracts.requests import BadRequest

POLL_S = 0.5
TRUE, FALSE = ("true", "1"), ("false", "0", "")


@dataclass(frozen=True)
class LogQuery:
    name: str
    instance: str = ""
    tail: int = 0          # <= 0: every line
    follow: bool = False
    since: datetime | None = None

    @classmethod
    def parse(cls, query: Mapping[str, str]) -> LogQuery:
        """The query string's parameters; BadRequest naming the one that is malformed."""
        name = query.get("name", "")
        if not name:
            raise BadRequest("the query parameter 'name' (the function) is required")
        try:
            tail = int(query.get("tail", "0") or 0)
        except ValueError:
            raise BadRequest(f"tail must be an integer, got {query['tail']!r}") from None
        follow = query.get("follow", "").lower()
        if follow not in TRUE + FALSE:
            raise BadRequest(f"follow must be true or false, got {query['follow']!r}")
        since = None
        if query.get("since"):
            try:
                since = datetime.fromisoformat(query["since"])
            except ValueError:
                raise BadRequest(f"since must be an RFC 3339 time, got {query['since']!r}") from None
            if since.tzinfo is None:
                raise BadRequest(f"since must carry its time zone (RFC 3339), got {query['since']!r}")
        return cls(name, query.get("instance", ""), tail, follow in TRUE, since)

    def wants(self, at: datetime, entry: LogEntry) -> bool:
        return (not self.instance or entry.instance == self.instance) and (self.since is None or at > self.since)


async def stream_logs(request: web.Request, query: LogQuery, log_file: Path, namespace: str,
                      timeout_s: float) -> web.StreamResponse:
    reader = LogReader(query.name, namespace)
    try:
        data = log_file.read_bytes()
    except FileNotFoundError:
        data = b""
    lines, partial = _lines(data)
    wanted = [e for at, e in reader.entries(lines) if query.wants(at, e)]
    out = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await out.prepare(request)
    for entry in wanted[-query.tail:] if query.tail > 0 else wanted:
        await out.write(entry.encode())
    if query.follow:
        await _follow(out, query, reader, log_file, len(data) - len(partial), time.monotonic() + timeout_s)
    await out.write_eof()
    return out


def _lines(data: bytes) -> tuple[list[str], bytes]:
    """The whole lines in `data`, and what follows the last newline (a line still being written)."""
    *whole, partial = data.split(b"\n")
    return [line.decode("utf-8", errors="replace") for line in whole], partial


async def _follow(out: web.StreamResponse, query: LogQuery, reader: LogReader, log_file: Path, offset: int,
                  deadline: float) -> None:
    """Lines as they are appended; a file truncated by rotation is read again from its start."""
    while time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
        try:
            with open(log_file, "rb") as f:
                if f.seek(0, 2) < offset:
                    offset = 0
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            continue
        lines, partial = _lines(data)
        offset += len(data) - len(partial)
        for at, entry in reader.entries(lines):
            if query.wants(at, entry):
                await out.write(entry.encode())   # raises once the client is gone
