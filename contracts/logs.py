"""The line every process of the runtime logs, and its reader: the embedded gateway's /system/logs
turns a function's log file back into OpenFaaS's LogEntry records (what `faas-cli logs` reads).
The process id in each line names the replica that wrote it (several share a function's file)."""
from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime

FORMAT = "%(asctime)s %(process)d %(name)s %(levelname)s %(message)s"
# What FORMAT's asctime and process fields look like at the head of a line.
HEADER = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (\d+) ")


def configure(level: str | int) -> None:
    logging.basicConfig(level=level, format=FORMAT)


@dataclass(frozen=True)
class LogEntry:
    """OpenFaaS's LogEntry (the gateway API's schema of that name)."""
    name: str
    namespace: str
    instance: str
    timestamp: str   # RFC 3339, UTC
    text: str

    def encode(self) -> bytes:
        """One line of the application/x-ndjson stream."""
        return json.dumps(asdict(self)).encode() + b"\n"


def rfc3339(t: datetime) -> str:
    return t.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass
class LogReader:
    """Reads one function's log lines into entries. A line without FORMAT's head (a traceback's,
    or what a library printed) belongs to the entry before it: same instance and time."""
    name: str
    namespace: str
    instance: str = ""
    at: datetime | None = None

    def entries(self, lines: Iterable[str]) -> Iterator[tuple[datetime, LogEntry]]:
        for line in lines:
            head = HEADER.match(line)
            if head:
                # asctime is the host's local time without a zone: read it as local, keep it as UTC.
                self.at = datetime.strptime(head.group(1), "%Y-%m-%d %H:%M:%S,%f").astimezone()
                self.instance = head.group(2)
            at = self.at or datetime.now().astimezone()
            yield at, LogEntry(self.name, self.namespace, self.instance, rfc3339(at), line)
