"""The line every process of the runtime logs, and its reader: the embedded gateway's /system/logs
turns a function's log file back into OpenFaaS's LogEntry records (what `faas-cli logs` reads).
The process id in each line names the replica that wrote it (several share a function's file).

Two formats (QUART_LOG_FORMAT): `text`, FORMAT's one line, and `json`, one object a line for log
collectors, carrying `request_id` where a line is about one request: the entry sets it for the
work of each request (`REQUEST_ID`, inherited by the tasks a request starts) and a stage passes
it for a work item (`extra={"request_id": header.request}`)."""
from __future__ import annotations

import contextvars
import json
import logging
import re
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime

FORMAT = "%(asctime)s %(process)d %(name)s %(levelname)s %(message)s"
# What FORMAT's asctime and process fields look like at the head of a line.
HEADER = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (\d+) ")

REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)


class JSONFormatter(logging.Formatter):
    """A log record as one JSON object (written here rather than taken from python-json-logger:
    the fields are few and fixed, and /system/logs reads them back)."""

    def format(self, record: logging.LogRecord) -> str:
        line = {"time": rfc3339(datetime.fromtimestamp(record.created, UTC)), "pid": record.process,
                "logger": record.name, "level": record.levelname, "message": record.getMessage()}
        request_id = getattr(record, "request_id", None) or REQUEST_ID.get()
        if request_id:
            line["request_id"] = request_id
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line)


def configure(level: str | int, fmt: str = "text") -> None:
    """Every process's logging: `level`, in the `text` or `json` format."""
    handler = logging.StreamHandler()
    handler.setFormatter(JSONFormatter() if fmt == "json" else logging.Formatter(FORMAT))
    logging.basicConfig(level=level, handlers=[handler])


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
            self._head(line)
            at = self.at or datetime.now().astimezone()
            yield at, LogEntry(self.name, self.namespace, self.instance, rfc3339(at), line)

    def _head(self, line: str) -> None:
        """The time and process of a line that starts an entry, in either format."""
        head = HEADER.match(line)
        if head:
            # asctime is the host's local time without a zone: read it as local, keep it as UTC.
            self.at = datetime.strptime(head.group(1), "%Y-%m-%d %H:%M:%S,%f").astimezone()
            self.instance = head.group(2)
        elif line.startswith("{"):
            try:
                record = json.loads(line)
                at, pid = datetime.fromisoformat(record["time"]), int(record["pid"])
            except (ValueError, KeyError, TypeError):
                return
            self.at, self.instance = at, str(pid)
