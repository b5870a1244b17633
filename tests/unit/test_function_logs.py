"""The log line every runtime process writes, read back as OpenFaaS LogEntry records, and the
query of GET /system/logs."""
from __future__ import annotations

import asyncio
import json
import logging
from datetime import UTC, datetime

import pytest

from contracts.logs import FORMAT, REQUEST_ID, JSONFormatter, LogReader
from contracts.requests import BadRequest
from contracts.wire import Header
from runtime.function_logs import LogQuery


def _line(message: str, pid: int = 4242) -> str:
    record = logging.LogRecord("quart.stage", logging.INFO, __file__, 1, message, None, None)
    record.process = pid
    return logging.Formatter(FORMAT).format(record)


def test_a_logged_line_reads_back_with_its_replica_and_time():
    written = _line("forked in 31 ms")
    (at, entry), = LogReader("smollm2-s0", "openfaas-fn").entries([written])
    assert (entry.name, entry.namespace, entry.instance, entry.text) == ("smollm2-s0", "openfaas-fn", "4242", written)
    assert abs((at - datetime.now(UTC)).total_seconds()) < 60
    assert entry.timestamp.endswith("Z") and datetime.fromisoformat(entry.timestamp) == at.replace(microsecond=at.microsecond // 1000 * 1000)
    assert set(json.loads(entry.encode())) == {"name", "namespace", "instance", "timestamp", "text"}


def test_lines_without_a_head_belong_to_the_entry_before():
    lines = [_line("step failed", pid=7), "Traceback (most recent call last):", '  File "x.py", line 1', _line("next", pid=8)]
    entries = [e for _, e in LogReader("f", "ns").entries(lines)]
    assert [e.instance for e in entries] == ["7", "7", "7", "8"]
    assert entries[1].timestamp == entries[0].timestamp


def _json_line(message: str, pid: int = 4242, **extra) -> str:
    record = logging.LogRecord("quart.stage", logging.INFO, __file__, 1, message, None, None)
    record.process = pid
    record.__dict__.update(extra)
    return JSONFormatter().format(record)


def test_json_lines_carry_the_request_they_are_about():
    """QUART_LOG_FORMAT=json: a stage's line names its work item's request (passed with the
    record); an entry's, the request its task serves (set once, inherited by the tasks it starts)."""
    header = Header(request_id="chatcmpl-3f2a.1.17", model="m", stage=0, reply_to="r", deadline=0.0)
    stage = json.loads(_json_line("decode at stage 2", request_id=header.request))
    assert stage["request_id"] == "chatcmpl-3f2a" and stage["pid"] == 4242 and stage["level"] == "INFO"
    assert "request_id" not in json.loads(_json_line("replica serving"))

    async def entry() -> list[dict]:
        REQUEST_ID.set("cmpl-77")
        child = asyncio.ensure_future(asyncio.sleep(0, _json_line("in a task the request started")))
        return [json.loads(_json_line("finished")), json.loads(await child)]

    assert [line["request_id"] for line in asyncio.run(entry())] == ["cmpl-77", "cmpl-77"]
    assert REQUEST_ID.get() is None   # another request's context is its own


def test_json_lines_read_back_as_entries_of_their_replica_and_time():
    lines = [_json_line("forked", pid=7), "Traceback (most recent call last):", _json_line("next", pid=8), "{not json"]
    read = list(LogReader("f", "ns").entries(lines))
    assert [e.instance for _, e in read] == ["7", "7", "8", "8"]
    assert read[0][1].timestamp == json.loads(lines[0])["time"]
    assert abs((read[0][0] - datetime.now(UTC)).total_seconds()) < 60


def test_a_query_reads_its_parameters_and_refuses_malformed_ones():
    q = LogQuery.parse({"name": "smollm2", "tail": "5", "follow": "true", "since": "2026-11-26T07:00:00Z", "instance": "9"})
    assert (q.name, q.tail, q.follow, q.instance) == ("smollm2", 5, True, "9")
    assert q.since == datetime(2026, 11, 26, 7, tzinfo=UTC)
    assert LogQuery.parse({"name": "f"}) == LogQuery("f")
    for bad, text in (({}, "name"), ({"name": "f", "tail": "x"}, "tail"), ({"name": "f", "follow": "maybe"}, "follow"),
                      ({"name": "f", "since": "yesterday"}, "since"), ({"name": "f", "since": "2026-11-26T07:00:00"}, "zone")):
        with pytest.raises(BadRequest, match=text):
            LogQuery.parse(bad)


def test_a_query_keeps_one_instance_and_lines_after_since():
    (at, entry), = LogReader("f", "ns").entries([_line("x", pid=3)])
    assert LogQuery("f", instance="3").wants(at, entry) and not LogQuery("f", instance="4").wants(at, entry)
    assert not LogQuery("f", since=at).wants(at, entry)
