"""A model's entry function: the endpoint users call. It validates a request, sends it through the
model's stage functions (pipeline_client.py) and answers: JSON, or server-sent events when a
generative request asks to stream.

Paths (under /function/<model>): POST / takes the native body ({prompt|messages, max_new_tokens}
for a generative model, {inputs} for embeddings); a generative model also serves OpenAI's
POST /v1/completions, POST /v1/chat/completions and GET /v1/models."""
from __future__ import annotations

import asyncio
import logging
import os
import random
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field, replace

import torch
from transformers import AutoTokenizer

from contracts.config import Settings
from contracts.logs import REQUEST_ID
from contracts.wire import BadRequest, StageTiming
from frontend import openai_api as oa
from frontend.entry_metrics import EntryMetrics
from frontend.entry_requests import (
    EMBED_MAX_TOKENS,
    check_prompt_chars,
    check_prompt_length,
    parse_embed,
    parse_emulated,
    parse_generate,
    parse_json,
)
from frontend.generation_gate import GenerationGate, Refused, Ticket
from frontend.objectives import Objectives
from frontend.pipeline_client import PipelineClient, Progress, SharedPrompt, StageFailed
from frontend.text_stream import TextStream
from models.fetch import ensure_model
from models.manifest import Manifest
from models.profiles import WIDTH as EMULATED_WIDTH
from models.profiles import profile as emulation_profile
from models.sampling import Sampling

log = logging.getLogger("quart.entry")


@dataclass
class Answer:
    """An HTTP answer: a JSON body, or (stream set) server-sent events."""
    status: int
    body: dict | None = None
    headers: dict[str, str] = field(default_factory=dict)
    stream: AsyncIterator[bytes] | None = None


@dataclass
class Generated:
    tokens: list[int]
    text: str
    finish: str           # "stop" (end of text or a stop sequence) or "length"
    ttft_s: float
    tpot_s: float
    progress: Progress

    @property
    def timing(self) -> dict:
        return {"ttft_ms": round(self.ttft_s * 1000.0, 3), "tpot_ms": round(self.tpot_s * 1000.0, 3),
                "steps": self.progress.steps, "recomputes": self.progress.recomputes}


class Entry:
    def __init__(self, settings: Settings, model: str) -> None:
        self.settings = settings
        self.model = model
        self.created = time.time()
        if settings.compute.emulate:
            self.arch = "emulated"
            emulation_profile(settings.compute.emulate)  # an unknown profile fails at start, not per request
        else:
            manifest = Manifest.load(ensure_model(settings, model))
            self.arch = "generate" if manifest.generative else "embed"
            self.context_length = manifest.context_length
            self.config = manifest.config_object()
            self.tokenizer = AutoTokenizer.from_pretrained(manifest.tokenizer_path())
            self.chars_per_token = max(len(t) for t in self.tokenizer.get_vocab())
            eos = self.config.eos_token_id
            self.eos = {e for e in (eos if isinstance(eos, list) else [eos]) if e is not None}
        self.client = PipelineClient(settings, model, f"{model}.{settings.server}.{os.getpid()}")
        data = settings.data
        self.gate = GenerationGate(Objectives(data.ttft_objective_s, data.tpot_objective_s, data.request_timeout_s))
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        # Generations hold a place at the gate; embeddings' and emulated passes are in flight at the stages.
        running = (lambda: self.gate.in_flight) if self.arch == "generate" else (lambda: self.client.admission.in_flight)
        self.metrics = EntryMetrics(model, running, lambda: self.gate.waiting)

    async def handle(self, method: str, path: str, body: bytes) -> Answer:
        path = "/" + path.strip("/")
        if path.startswith("/v1/") and self.arch != "emulated":
            return await self._openai(method, path, body)
        if path != "/":
            return Answer(404, {"error": f"no such path {path!r}; POST / (or /v1/... on a generative model)"})
        if method != "POST":
            return Answer(405, {"error": "POST a JSON request to this model"})
        return await self._native(body)

    # -- the native body ---------------------------------------------------------------------

    async def _native(self, body: bytes) -> Answer:
        request_id = uuid.uuid4().hex[:16]
        REQUEST_ID.set(request_id)
        started = time.time()
        try:
            data = parse_json(body)
            handler = {"generate": self._generate, "embed": self._embed, "emulated": self._emulated}[self.arch]
            answer = await handler(data, request_id, started)
        except BadRequest as exc:
            return Answer(exc.status, {"error": str(exc)})
        except StageFailed as exc:
            return Answer(exc.status, {"error": str(exc), "id": request_id}, _retry_after(exc))
        except TimeoutError:
            return Answer(504, {"error": f"request {request_id} did not finish within "
                                         f"{self.settings.data.request_timeout_s:g} s", "id": request_id})
        answer["id"] = request_id
        answer["latency_ms"] = round((time.time() - started) * 1000.0, 3)
        return Answer(200, answer)

    async def _generate(self, data: dict, request_id: str, started: float) -> dict:
        req = parse_generate(data, self.settings.limits.max_new_tokens)
        ids = await self._prompt_ids(req.prompt, req.messages, req.max_new_tokens)
        ticket = self._ticket(started, req.max_new_tokens, 1)
        try:
            await ticket.wait(self._left_s(started))
            done = await self._run(Choice(request_id, Sampling()), ids, req.max_new_tokens, [], started, ticket,
                                   req.ignore_eos)
        finally:
            ticket.close()
        self._finished(len(ids), len(done.tokens), done.finish, started)
        return {"text": done.text, "token_ids": done.tokens, "passes": done.progress.steps,
                "finish_reason": done.finish, **done.timing, "queued_ms": round(ticket.queued_s * 1000.0, 3),
                "stages": _sum_timings(done.progress.timings)}

    def _ticket(self, started: float, tokens: int, weight: int) -> Ticket:
        """The request's place in flight (frontend/objectives.py), or 429 when it is predicted to
        miss its deadline; not while the stages start from zero (requests queue behind the first,
        as in an activator)."""
        try:
            return self.gate.enter(started, tokens, weight)
        except Refused as exc:
            if self.client.waking():
                return self.gate.enter(started, tokens, weight, force=True)
            raise StageFailed(429, f"{self.model} is overloaded: this request is {exc}",
                              exc.decision.retry_after_s) from None

    def _finished(self, prompt_tokens: int, generated: int, reason: str, started: float) -> None:
        """A request answered in full: its metrics and one line in the log (the request's id in it)."""
        latency_s = time.time() - started
        self.metrics.finished(prompt_tokens, generated, reason, latency_s)
        log.info("finished: %d prompt tokens, %d generated (%s) in %.0f ms", prompt_tokens, generated, reason,
                 latency_s * 1000.0)

    def _left_s(self, started: float) -> float:
        return started + self.settings.data.request_timeout_s - time.time()

    async def _embed(self, data: dict, request_id: str, started: float) -> dict:
        inputs = parse_embed(data, self.settings.limits.max_inputs)
        self.client.admit()
        enc = await self._embedding_inputs(inputs)
        header, out = await self.client.round_trip(f"{request_id}.0", dict(enc), started + self.settings.data.request_timeout_s)
        self._finished(int(enc["attention_mask"].sum()), 0, "stop", started)
        return {"embeddings": out["embeddings"].tolist(), "stages": _sum_timings([header.timings])}

    async def _embedding_inputs(self, inputs: list[str]) -> dict:
        # Only the first EMBED_MAX_TOKENS tokens are embedded: the rest of a long input is not read.
        longest = min(EMBED_MAX_TOKENS, self.context_length)
        inputs = [text[:longest * self.chars_per_token] for text in inputs]
        return await self._tokenized(self.tokenizer, inputs, padding=True, truncation=True, max_length=longest,
                                     return_tensors="pt")

    async def _emulated(self, data: dict, request_id: str, started: float) -> dict:
        tokens = parse_emulated(data, self.settings.limits.max_prompt_tokens)
        self.client.admit()
        header, _ = await self.client.round_trip(f"{request_id}.0", {"hidden": torch.zeros(1, tokens, EMULATED_WIDTH)},
                                                 started + self.settings.data.request_timeout_s)
        self._finished(tokens, 0, "stop", started)
        return {"emulated": True, "tokens": tokens, "stages": _sum_timings([header.timings])}

    # -- OpenAI's surface --------------------------------------------------------------------

    async def _openai(self, method: str, path: str, body: bytes) -> Answer:
        routes = {"/v1/models": "GET", **({"/v1/completions": "POST", "/v1/chat/completions": "POST"}
                                          if self.arch == "generate" else {"/v1/embeddings": "POST"})}
        if path not in routes:
            what = "generates text" if self.arch == "generate" else "embeds text"
            return Answer(404, oa.error_body(f"{self.model} {what}: it serves {sorted(routes)}, not {path!r}", 404))
        if method != routes[path]:
            return Answer(405, oa.error_body(f"{path} takes {routes[path]}, not {method}", 405))
        if path == "/v1/models":
            return Answer(200, oa.models_body([oa.model_card(self.model, self.created, self.context_length)]))
        if path == "/v1/embeddings":
            return await self._openai_embeddings(body)
        started = time.time()
        try:
            parse_json(body)  # its checks first: text that is not UTF-8, nesting too deep
            req = oa.parse_openai(body, path.endswith("chat/completions"), self.model, self.context_length,
                                  self.settings.limits.max_new_tokens, random.getrandbits(31))
            if req.ignored:  # vLLM's behaviour: a client's extra fields are not an error
                log.warning("%s: ignoring fields this server does not know: %s", path, req.ignored)
            ids = await self._prompt_ids(req.prompt, req.messages, req.max_tokens)
            ticket = self._ticket(started, req.max_tokens, req.n)
        except (BadRequest, StageFailed) as exc:
            return self._openai_failure(exc)
        rid = ("chatcmpl-" if req.chat else "cmpl-") + uuid.uuid4().hex[:24]
        REQUEST_ID.set(rid)
        if req.stream:
            return Answer(200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"},
                          stream=_Closing(self._sse(req, rid, ids, started, ticket), ticket.close))
        try:
            await ticket.wait(self._left_s(started))
            done = await _all([self._run(c, ids, req.max_tokens, req.stop, started, ticket, req.ignore_eos)
                               for c in _choices(req, rid)])
        except (StageFailed, TimeoutError) as exc:
            return self._openai_failure(exc)
        finally:
            ticket.close()
        generated = sum(len(d.tokens) for d in done)
        self._finished(len(ids), generated, done[0].finish, started)
        choices = [oa.choice_body(req, i, d.text, d.finish, oa.logprobs_body(req, d.progress.logprobs, self._token_text))
                   for i, d in enumerate(done)]
        return Answer(200, oa.response_body(req, rid, self.model, choices,
                                            oa.usage(len(ids), generated), done[0].timing))

    def _openai_failure(self, exc: BadRequest | StageFailed | TimeoutError) -> Answer:
        """A request that failed, in OpenAI's error shape (the parameter named where one was wrong)."""
        if isinstance(exc, TimeoutError):
            return Answer(504, oa.error_body(f"not finished within {self.settings.data.request_timeout_s:g} s", 504))
        if isinstance(exc, oa.OpenAIError):
            return Answer(exc.status, oa.error_body(str(exc), exc.status, exc.param, exc.code))
        headers = _retry_after(exc) if isinstance(exc, StageFailed) else {}
        return Answer(exc.status, oa.error_body(str(exc), exc.status), headers)

    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    async def _openai_embeddings(self, body: bytes) -> Answer:
        started = time.time()
        request_id = uuid.uuid4().hex[:16]
        REQUEST_ID.set(request_id)
        try:
            parse_json(body)
            req = oa.parse_embeddings(body, self.model, self.settings.limits.max_inputs)
            self.client.admit()
            enc = await self._embedding_inputs(req.inputs)
            _, out = await self.client.round_trip(f"{request_id}.0", dict(enc),
                                                  started + self.settings.data.request_timeout_s)
        except (BadRequest, StageFailed, TimeoutError) as exc:
            return self._openai_failure(exc)
        tokens = int(enc["attention_mask"].sum())
        self._finished(tokens, 0, "stop", started)
        return Answer(200, oa.embeddings_body(self.model, out["embeddings"], req.encoding_format, tokens))

    async def _sse(self, req: oa.OpenAIRequest, rid: str, ids: list[int], started: float,
                   ticket: Ticket) -> AsyncIterator[bytes]:
        """The stream's events, every choice's interleaved as they come, once the request has its
        place; an error after the stream began is sent as an error event and ends it."""
        events: asyncio.Queue = asyncio.Queue()
        try:
            await ticket.wait(self._left_s(started))
        except TimeoutError:
            yield oa.sse(oa.error_body(f"not started within {self.settings.data.request_timeout_s:g} s", 504))
            yield oa.DONE
            return
        tasks = [asyncio.ensure_future(self._choice_events(req, rid, c, ids, started, ticket, events))
                 for c in _choices(req, rid)]
        try:
            finished: list[Generated] = []
            while len(finished) < len(tasks):
                event = await events.get()
                if isinstance(event, Generated):
                    finished.append(event)
                elif isinstance(event, Exception):
                    status = getattr(event, "status", 504)
                    message = str(event) or f"not finished within {self.settings.data.request_timeout_s:g} s"
                    yield oa.sse(oa.error_body(message, status))
                    break
                else:
                    yield event
            else:
                generated = sum(len(d.tokens) for d in finished)
                self._finished(len(ids), generated, finished[0].finish, started)
                if req.include_usage:
                    yield oa.usage_chunk(req, rid, self.model, oa.usage(len(ids), generated),
                                         finished[0].timing)
            yield oa.DONE
        finally:
            # A client gone mid-stream ends the generations now, which frees their caches.
            for task in tasks:
                task.cancel()

    async def _choice_events(self, req: oa.OpenAIRequest, rid: str, choice: Choice, ids: list[int], started: float,
                             ticket: Ticket, events: asyncio.Queue) -> None:
        """One choice's chunks onto `events`, then its summary (or the exception that ended it)."""
        progress, first, sent = Progress(), True, 0
        texts = self._texts(choice, ids, req.max_tokens, req.stop, started, ticket, req.ignore_eos, progress)
        try:
            async with aclosing(texts):
                async for text, done in texts:
                    if done is None and not (text or first):
                        continue  # held back (a possible stop sequence, a partial character)
                    logprobs = oa.logprobs_body(req, progress.logprobs[sent:], self._token_text)
                    sent = len(progress.logprobs)
                    events.put_nowait(oa.chunk(req, rid, self.model, text if done is None else text or None,
                                               done.finish if done else None, first, choice.index, logprobs))
                    first = False
                    if done is not None:
                        events.put_nowait(done)
        except (StageFailed, TimeoutError) as exc:
            events.put_nowait(exc)

    # -- generation --------------------------------------------------------------------------

    async def _tokenized(self, call, *args, **kwargs):
        """`call(*args, **kwargs)` on the tokenizer's own thread: a body of megabytes takes seconds
        to tokenize and other requests go on meanwhile; one thread, as a fast tokenizer with
        truncation set must not be used by two threads at once."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, lambda: call(*args, **kwargs))

    async def _prompt_ids(self, prompt: str | None, messages: list[dict] | None, max_new: int) -> list[int]:
        chars = len(prompt) if prompt is not None else sum(len(m["content"]) for m in messages)
        check_prompt_chars(chars, self.settings.limits.max_prompt_tokens, self.chars_per_token)
        if prompt is not None:
            ids = (await self._tokenized(self.tokenizer, prompt))["input_ids"]
        else:
            try:
                ids = list((await self._tokenized(self.tokenizer.apply_chat_template, messages, add_generation_prompt=True,
                                                  tokenize=True, return_dict=True))["input_ids"])
            except Exception as exc:  # the model's own template refuses (a role it has no turn for, ...)
                raise BadRequest(f"the model's chat template refused these messages: {exc}") from None
        check_prompt_length(len(ids), max_new, self.settings.limits.max_prompt_tokens,
                            self.config.max_position_embeddings)
        return ids

    async def _run(self, choice: Choice, ids: list[int], max_new: int, stop: list[str], started: float,
                   ticket: Ticket, ignore_eos: bool = False) -> Generated:
        text = []
        async with aclosing(self._texts(choice, ids, max_new, stop, started, ticket, ignore_eos, Progress())) as texts:
            async for piece, done in texts:
                text.append(piece)
                if done is not None:
                    done.text = "".join(text)
                    return done
        raise AssertionError("a generation always ends with its summary")

    async def _texts(self, choice: Choice, ids: list[int], max_new: int, stop: list[str], started: float,
                     ticket: Ticket, ignore_eos: bool, progress: Progress) -> AsyncIterator[tuple[str, Generated | None]]:
        """(text released, None) per token, then (the rest, the summary)."""
        tokens, stream = [], TextStream(self.tokenizer, stop)
        first_at = None
        finish = "length"
        tokens_iter = self.client.generate(choice.rid, ids, max_new, choice.sampling,
                                           started + self.settings.data.request_timeout_s, progress, choice.share,
                                           choice.index, () if ignore_eos else self.eos)
        try:
            async for token in tokens_iter:
                ticket.token(choice.index)
                tokens.append(token)
                if first_at is None:
                    first_at = time.time()
                if token in self.eos and not ignore_eos:
                    finish = "stop"
                    break
                piece = stream.push(token)
                if stream.stopped:
                    finish = "stop"
                    yield piece, None
                    break
                yield piece, None
        finally:
            await tokens_iter.aclose()
        ended = time.time()
        first_at = first_at or ended
        ttft = first_at - started
        tpot = (ended - first_at) / (len(tokens) - 1) if len(tokens) > 1 else 0.0
        self.metrics.generated(ttft, tpot, len(tokens))
        yield stream.finish(), Generated(tokens, "", finish, ttft, tpot, progress)


class _Closing:
    """A streamed body whose closing, even before its first chunk, calls `on_close` (an async
    generator closed unstarted runs none of its code)."""

    def __init__(self, events: AsyncIterator[bytes], on_close) -> None:
        self._events, self._on_close = events, on_close

    def __aiter__(self) -> _Closing:
        return self

    async def __anext__(self) -> bytes:
        return await self._events.__anext__()

    async def aclose(self) -> None:
        try:
            await self._events.aclose()
        finally:
            self._on_close()


@dataclass
class Choice:
    """One sequence a request generates: its id, its sampling, and (n > 1) its index and the
    prefill it shares with the request's other choices."""
    rid: str
    sampling: Sampling
    index: int = 0
    share: SharedPrompt | None = None


def _choices(req: oa.OpenAIRequest, rid: str) -> list[Choice]:
    """The request's `n` choices: seeds apart, so that sampled choices differ and each is
    reproducible, sharing one prefill."""
    if req.n == 1:
        return [Choice(rid, req.sampling)]
    share = SharedPrompt(req.n)
    return [Choice(f"{rid}-{i}", replace(req.sampling, seed=req.sampling.seed + i), i, share) for i in range(req.n)]


async def _all(coros: list) -> list:
    """Every result, or the first exception with the rest cancelled (their caches freed)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()


def _retry_after(exc: StageFailed) -> dict[str, str]:
    return {"Retry-After": str(max(1, round(exc.retry_after)))} if exc.status == 429 else {}


def _sum_timings(passes: list[list[StageTiming]]) -> list[dict]:
    """Per stage: total queue and service time over all passes, and the replica of the last."""
    by_stage: dict[int, dict] = {}
    for timings in passes:
        for t in timings:
            s = by_stage.setdefault(t.stage, {"stage": t.stage, "queue_ms": 0.0, "service_ms": 0.0})
            s["replica"] = t.replica
            s["queue_ms"] = round(s["queue_ms"] + t.queue_ms, 3)
            s["service_ms"] = round(s["service_ms"] + t.service_ms, 3)
    return [by_stage[k] for k in sorted(by_stage)]
