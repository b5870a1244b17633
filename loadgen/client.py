"""Open-loop replay: every request leaves at its scheduled time whatever the others are doing
(one asyncio task each, no cap on requests in flight), and the gap between schedule and send is
recorded. A progress bar counts answers; Ctrl-C stops sending, gives the requests in flight a
grace period, and still returns everything measured."""
from __future__ import annotations

import asyncio
import json
import signal
import time
from dataclasses import asdict, dataclass, field

import aiohttp

from loadgen.requests import Request

FUNCTION_PATH = "/function/{model}"   # the gateway's: a model's function, its own request body
OPENAI_PATH = "/v1/completions"       # any OpenAI-compatible server's completions


@dataclass
class Record:
    index: int
    model: str
    scheduled: float          # seconds after the start
    sent: float = -1.0        # seconds after the start; -1: never sent
    latency_s: float = -1.0
    status: int = 0           # HTTP status; 0: no answer (refused, timed out, stopped)
    prompt_tokens: int = 0
    output_tokens: int = 0
    stages: list[dict] = field(default_factory=list)  # per-stage queue and service ms
    error: str = ""
    ttft_s: float = -1.0      # time to first token and per output token, as the answer reports them;
    tpot_s: float = -1.0      # -1: not a generation (or not answered)
    queued_s: float = -1.0    # how long a generation waited at the entry for its place; -1: not reported

    @property
    def ok(self) -> bool:
        return self.status == 200

    @property
    def schedule_error_s(self) -> float:
        return self.sent - self.scheduled if self.sent >= 0 else float("nan")

    def as_json(self) -> str:
        return json.dumps(asdict(self))


def _output_tokens(answer: dict) -> int:
    if isinstance(answer.get("token_ids"), list):
        return len(answer["token_ids"])
    usage = answer.get("usage")  # an OpenAI-compatible server's answer
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        return usage["completion_tokens"]
    return 0


async def _read_stream(resp: aiohttp.ClientResponse, rec: Record, sent: float) -> None:
    """An OpenAI-compatible server's streamed completion (server-sent events): TTFT at the first
    chunk that carries text, TPOT over the rest, tokens from the closing usage where it comes (else
    one a text chunk); an error event in the stream fails the record."""
    loop = asyncio.get_running_loop()
    first, chunks, usage = None, 0, None
    async for line in resp.content:
        if not line.startswith(b"data:"):
            continue
        if (data := line[5:].strip()) == b"[DONE]":
            break
        event = json.loads(data)
        if isinstance(event.get("error"), dict):
            rec.status, rec.error = 0, str(event["error"].get("message", event["error"]))[:200]
            return
        if any(c.get("text") or (c.get("delta") or {}).get("content") for c in event.get("choices") or []):
            chunks += 1
            first = loop.time() if first is None else first
        usage = event.get("usage") or usage
    end = loop.time()
    rec.output_tokens = _output_tokens({"usage": usage}) or chunks
    if first is not None:
        rec.ttft_s = first - sent
        rec.tpot_s = (end - first) / (rec.output_tokens - 1) if rec.output_tokens > 1 else 0.0


async def _send(session: aiohttp.ClientSession, url: str, req: Request, rec: Record, t0: float) -> None:
    loop = asyncio.get_running_loop()
    rec.sent = loop.time() - t0
    try:
        async with session.post(url, json=req.body) as resp:
            rec.status = resp.status
            if rec.ok and req.body.get("stream"):
                await _read_stream(resp, rec, t0 + rec.sent)
                rec.latency_s = loop.time() - t0 - rec.sent
                return
            body = await resp.read()
        rec.latency_s = loop.time() - t0 - rec.sent
        if rec.ok:
            answer = json.loads(body)
            rec.output_tokens = _output_tokens(answer)
            rec.stages = answer.get("stages", [])
            if "ttft_ms" in answer:
                rec.ttft_s, rec.tpot_s = answer["ttft_ms"] / 1000.0, answer["tpot_ms"] / 1000.0
                rec.queued_s = answer.get("queued_ms", -1000.0) / 1000.0
        else:
            rec.error = body[:200].decode(errors="replace")
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        rec.latency_s = loop.time() - t0 - rec.sent
        rec.status, rec.error = 0, f"{type(exc).__name__}: {exc}"  # no whole answer, whatever the status said


async def replay(gateway: str, requests: list[Request], timeout_s: float = 300.0, progress: bool = True,
                 grace_s: float = 10.0, path: str = FUNCTION_PATH) -> list[Record]:
    """Sends each request at its time to POST <gateway><path> (`path` may name the request's
    {model}; OPENAI_PATH for another server's OpenAI-compatible completions, with bodies in its
    form); returns one Record per request, in schedule order."""
    from tqdm import tqdm
    records = [Record(r.index, r.model, r.at, prompt_tokens=r.prompt_tokens) for r in requests]
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    try:
        loop.add_signal_handler(signal.SIGINT, stop.set)
        owns_sigint = True
    except (NotImplementedError, RuntimeError):  # not the main thread: Ctrl-C stays the caller's
        owns_sigint = False
    bar = tqdm(total=len(requests), unit="req", disable=not progress, dynamic_ncols=True)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    tasks: list[asyncio.Task] = []
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        t0 = loop.time()
        for req, rec in zip(requests, records):
            delay = t0 + req.at - loop.time()
            if delay > 0:
                try:
                    await asyncio.wait_for(stop.wait(), delay)
                except TimeoutError:
                    pass
            if stop.is_set():
                break
            task = asyncio.create_task(_send(session, gateway + path.format(model=req.model), req, rec, t0))
            task.add_done_callback(lambda _: bar.update(1))
            tasks.append(task)
        if tasks:
            answered = asyncio.ensure_future(asyncio.wait(tasks))
            stopped = asyncio.ensure_future(stop.wait())
            await asyncio.wait({answered, stopped}, return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            pending = [t for t in tasks if not t.done()]
            if pending:  # Ctrl-C: a grace period for the answers under way, then give up on them
                _, pending = await asyncio.wait(pending, timeout=grace_s)
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                for rec in records:
                    if rec.sent >= 0 and rec.status == 0 and not rec.error:
                        rec.error = "stopped before an answer came"
            await answered
    bar.close()
    if owns_sigint:
        loop.remove_signal_handler(signal.SIGINT)
    return records


def run(gateway: str, requests: list[Request], **kw) -> tuple[list[Record], float]:
    """The replay, and the wall-clock time it started (to line it up with Redis timelines)."""
    started = time.time()
    return asyncio.run(replay(gateway, requests, **kw)), started
