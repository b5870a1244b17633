"""An entry replica's side of the pipeline: it sends work to the first stage, receives every
answer on its own reply list, and drives a generative request token by token.

A request's prefill enters stage 0's shared stream (any replica may take it); each stage that runs
it keeps the request's KV cache and writes its own id into the route, which comes back with the
first token. Every decode step then goes to the replica holding the cache at stage 0, and each
stage forwards it to the holder at the next; the last stage sends the next step itself
(`Header.chain`, QUART_CHAIN_STEPS) while the entry streams the token. When a holder is gone (killed, or its cache expired),
the entry prefills again, with the prompt and the tokens it already has, on live replicas
(recomputation): the request still answers, once, with the same tokens."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass, field

import redis
import redis.asyncio as aioredis
import torch

from contracts.config import Settings
from contracts.wire import MESSAGE_FIELD, BadRequest, Header, StageTiming, pack, step_id, unpack
from frontend.admission import Admission
from frontend.step_sender import StepSender
from models.sampling import Sampling, TokenLogprob, answers
from state import keys
from state.records import StartFailure
from state.store import RedisStore

log = logging.getLogger("quart.entry")
# A request whose caches are lost this many times in a row fails rather than loop.
MAX_RECOMPUTES = 5
# How long a request waits for an unreachable Redis (a supervised one is back within seconds)
# before it is answered 503.
REDIS_WAIT_S = 10.0
# The most answers the reply reader takes from the list in one read.
REPLIES_AT_ONCE = 256


class StageFailed(Exception):
    def __init__(self, status: int, message: str, retry_after: float = 0.0) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


@dataclass
class Progress:
    """What a generation has done so far, for its response and its metrics."""
    steps: int = 0
    recomputes: int = 0
    timings: list[list[StageTiming]] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per token, where the sampling asks


@dataclass
class Shared:
    """A prefill that several choices share: its sequence, the replicas holding it, and each
    choice's first token with its log-probabilities."""
    seq: str
    route: dict[str, str]
    answers: list[tuple[int, TokenLogprob | None]]


@dataclass
class SharedPrompt:
    """How a request's choices share one prefill: choice 0 sets `done` to the Shared prefill, or
    to None when it could not (each choice then prefills itself)."""
    choices: int
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class PipelineClient:
    def __init__(self, settings: Settings, model: str, entry_id: str) -> None:
        self.settings = settings
        self.model = model
        self.reply_key = keys.reply_list(entry_id)
        self.first_stream = keys.stage_stream(model, 0)
        self._redis: aioredis.Redis | None = None
        self._pending: dict[str, asyncio.Future] = {}
        self._dispatcher: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        self.admission = Admission(settings.data.admit_wait_s)
        self._sync_redis: redis.Redis | None = None
        self._sender = StepSender(self._connection)

    def admit(self) -> None:
        """StageFailed(429) when the stages are too far behind to take a new request in time."""
        now = time.time()
        retry_after = self.admission.refusal(now)
        if retry_after is not None and self.waking():
            return  # the stages are starting from zero: requests queue behind the first, as in an activator
        if retry_after is not None:
            raise StageFailed(429, f"{self.model} is overloaded: a request would queue longer than the "
                                   f"{self.admission.max_wait_s:g} s allowed before its first pass", retry_after)

    def waking(self) -> bool:
        """Whether the gateway is starting this model's stages from zero (asked only before a
        refusal, which is rare, so a blocking look at Redis costs little)."""
        if self._sync_redis is None:
            self._sync_redis = redis.Redis.from_url(self.settings.redis_url, socket_timeout=1.0)
        try:
            return RedisStore(self._sync_redis).waking(self.model)
        except redis.RedisError:
            return False

    # -- one pass ----------------------------------------------------------------------------

    async def round_trip(self, pass_id: str, tensors: dict[str, torch.Tensor],
                         deadline: float) -> tuple[Header, dict[str, torch.Tensor]]:
        """One pass through every stage (embeddings, emulated models)."""
        header = Header(request_id=pass_id, model=self.model, stage=0, reply_to=self.reply_key, deadline=deadline)
        reply = await self._send_and_wait(header, tensors, self.first_stream, {}, deadline)
        if reply is None:
            raise StageFailed(503, f"pass {pass_id} was lost")
        return _checked(reply)

    # -- a generation ------------------------------------------------------------------------

    async def generate(self, request_id: str, prompt: list[int], max_new: int, sampling: Sampling,
                       deadline: float, progress: Progress, share: SharedPrompt | None = None,
                       choice: int = 0, stop_tokens: Collection[int] = ()) -> AsyncIterator[int]:
        """The request's new tokens as they come. Closing the iterator early (end of text, a
        stop sequence, a client that went away) frees the request's caches. With `share`, this
        is choice `choice` of several that share the prompt's prefill: choice 0 runs it, sampling
        every choice's first token; the others copy its cache (a fork) and decode on their own.
        `stop_tokens`: those after which the caller closes the iterator (no step follows them)."""
        new: list[int] = []
        route: dict[str, str] = {}
        seq = ""
        following = ""  # the step the last stage sent on by itself: its answer comes unasked
        chain = {"chain": self.settings.batching.chain_steps, "stop_tokens": sorted(stop_tokens)}
        lead = share is not None and choice == 0
        try:
            if share is not None and choice > 0 and (shared := await share.done) is not None:
                token, logprob = shared.answers[choice]
                new.append(token)
                progress.logprobs += [logprob] if logprob else []
                yield token
                if len(new) < max_new:
                    seq = f"{request_id}.{progress.recomputes}"
                    route = await self._fork(seq, shared, len(prompt), len(prompt) + max_new, deadline)
            while len(new) < max_new:
                if not route:
                    seq = f"{request_id}.{progress.recomputes}"
                    choices = share.choices if lead and not new else 1
                    header = self._header(seq, 0, deadline, kind="prefill", capacity=len(prompt) + max_new,
                                          sampling={**sampling.to_dict(), "choices": choices}, **chain)
                    reply = await self._send_and_wait(header, {"input_ids": torch.tensor([prompt + new])},
                                                      self.first_stream, {}, deadline)
                elif following:
                    reply = await self._wait(following, route, deadline)
                else:
                    start = len(prompt) + len(new) - 1
                    header = self._header(seq, start, deadline, kind="decode", start=start, route=route,
                                          sampling=sampling.to_dict(), **chain)
                    reply = await self._send_and_wait(header, {"input_ids": torch.tensor([[new[-1]]])},
                                                      keys.replica_stream(route["0"]), route, deadline)
                following = reply[0].next_step if reply is not None else ""
                if reply is None:
                    if lead and not share.done.done():
                        share.done.set_result(None)  # the others prefill for themselves
                    progress.recomputes += 1
                    log.info("%s: a stage lost its cache; prefilling again (%d)", request_id, progress.recomputes)
                    if progress.recomputes > MAX_RECOMPUTES:
                        raise StageFailed(503, f"request {request_id} lost its caches {progress.recomputes} times")
                    self._free_later(seq, route)
                    route = {}
                    continue
                # The route first, on an error too: a stage that refused the request (no room for
                # its cache) leaves the caches of the stages before it to free now, not when they
                # idle out a request timeout later.
                route = reply[0].route or route
                header, out = _checked(reply)
                progress.steps += 1
                progress.timings.append(header.timings)
                chosen = answers(out)
                if lead and not share.done.done():
                    share.done.set_result(Shared(seq, dict(route), chosen))
                token, logprob = chosen[0]
                new.append(token)
                progress.logprobs += [logprob] if logprob else []
                yield token
        finally:
            if lead and not share.done.done():
                share.done.set_result(None)
            self._forget(following)
            if route:
                self._free_later(seq, route)

    async def _fork(self, seq: str, shared: Shared, length: int, capacity: int, deadline: float) -> dict[str, str]:
        """Copies the shared prompt's cache into `seq` at every holder of the prefill: the route
        `seq` decodes through, or {} when the copy was lost (the parent gone, no room)."""
        header = self._header(seq, "fork", deadline, kind="fork", parent=shared.seq, start=length, capacity=capacity,
                              route=shared.route)
        reply = await self._send_and_wait(header, {}, keys.replica_stream(shared.route["0"]), shared.route, deadline)
        if reply is None:
            self._free_later(seq, shared.route)  # the holders before the one that lost it made their copy
            return {}
        return _checked(reply)[0].route

    def _header(self, seq: str, step: int | str, deadline: float, **fields) -> Header:
        """A step of `seq`: a prefill or decode step named by its start (`step_id`), a fork or
        free by its kind."""
        return Header(request_id=step_id(seq, step) if isinstance(step, int) else f"{seq}.{step}", model=self.model,
                      stage=0, reply_to=self.reply_key, deadline=deadline, seq=seq, **fields)

    async def _send_and_wait(self, header: Header, tensors: dict[str, torch.Tensor], stream: str,
                             route: dict[str, str], deadline: float) -> tuple[Header, dict] | None:
        """Sends one step and waits for its answer (`_wait`)."""
        self._pending[header.request_id] = asyncio.get_running_loop().create_future()
        first_pass = stream == self.first_stream
        if first_pass:
            self.admission.sent(header.request_id, time.time())
        reply = None
        try:
            message = pack(header, tensors)
            added = await self._while_redis_returns(lambda: self._sender.xadd(stream, message, bool(route)), deadline)
            if added is not None:
                reply = await self._wait(header.request_id, route, deadline, first_pass)
            return reply
        finally:
            self._pending.pop(header.request_id, None)
            if first_pass:
                service_s = sum(t.service_ms for t in reply[0].timings) / 1000.0 if reply else None
                self.admission.answered(header.request_id, service_s, time.time())

    async def _wait(self, step: str, route: dict[str, str], deadline: float,
                    first_pass: bool = False) -> tuple[Header, dict] | None:
        """The answer to `step`, sent by this entry or by the last stage (`Header.next_step`):
        None when it was lost (a stage answered "lost", the holder's stream is gone, or a holder
        in the route stopped heartbeating)."""
        future = self._pending.setdefault(step, asyncio.get_running_loop().create_future())
        check_s = self.settings.data.reclaim_idle_ms / 1000.0
        try:
            while True:
                left = deadline - time.time()
                if left <= 0:
                    raise TimeoutError
                try:
                    reply = await asyncio.wait_for(asyncio.shield(future), timeout=min(left, check_s))
                except TimeoutError:
                    if route and not await self._while_redis_returns(lambda: self._all_alive(route), deadline):
                        return None
                    if first_pass and (why := await self._while_redis_returns(self._unstartable, deadline)):
                        raise StageFailed(503, why, retry_after=check_s) from None
                    continue
                return None if reply[0].kind == "lost" else reply
        finally:
            self._pending.pop(step, None)

    def _forget(self, step: str) -> None:
        """Stops awaiting `step` and the steps the last stage sent on after it, whose answers
        came already (a generation that ended while they ran)."""
        while step and (future := self._pending.pop(step, None)) is not None:
            step = future.result()[0].next_step if future.done() else ""

    async def _while_redis_returns(self, call, deadline: float):
        """`call()`'s result, trying again while Redis cannot be reached (down, or loading its
        file after a restart) for up to REDIS_WAIT_S within the deadline; then 503."""
        give_up = min(deadline, time.time() + REDIS_WAIT_S)
        pause = 0.1
        while True:
            try:
                return await call()
            except (aioredis.ConnectionError, OSError) as exc:
                if time.time() + pause >= give_up:
                    raise StageFailed(503, f"the data plane's Redis is unreachable ({exc})", retry_after=1.0) from None
                await asyncio.sleep(pause)
                pause = min(1.0, pause * 2)

    async def _unstartable(self) -> str | None:
        """Why a stage of this model cannot serve: its latest replica failed to start (a shard
        that failed its checksum) and none is live; None while every stage may yet answer."""
        r = await self._connection()
        for stage, raw in sorted((await r.hgetall(keys.start_failures(self.model))).items()):
            members = await r.smembers(keys.stage_replicas(self.model, int(stage)))
            if not members or not await r.exists(*[keys.replica(m.decode()) for m in members]):
                return f"stage {int(stage)} of {self.model} cannot start: {StartFailure.decode(raw).reason}"
        return None

    async def _all_alive(self, route: dict[str, str]) -> bool:
        r = await self._connection()
        return await r.exists(*[keys.replica(rid) for rid in set(route.values())]) == len(set(route.values()))

    def _free_later(self, seq: str, route: dict[str, str]) -> None:
        """Tells every holder to drop a sequence, without making the caller wait (or be
        cancelled on the way): a holder that misses it frees the sequence when it idles out."""
        task = asyncio.get_running_loop().create_task(self._free(seq, route))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _free(self, seq: str, route: dict[str, str]) -> None:
        try:
            r = await self._connection()
            message = pack(self._header(seq, "free", time.time() + 60, kind="free"), {})
            pipe = r.pipeline(transaction=False)
            for rid in set(route.values()):
                pipe.xadd(keys.replica_stream(rid), {MESSAGE_FIELD: message}, nomkstream=True)
            await pipe.execute()
        except (aioredis.ConnectionError, OSError) as exc:
            log.warning("could not free %s: %s", seq, exc)

    async def aclose(self) -> None:
        """Sends the frees still under way and lets go of Redis. An event loop that ends without
        it drops them, and the holders keep those caches until they idle out."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=5)
        if self._dispatcher is not None:
            self._dispatcher.cancel()
            await asyncio.gather(self._dispatcher, return_exceptions=True)
            self._dispatcher = None
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None

    # -- the reply list ----------------------------------------------------------------------

    async def _connection(self) -> aioredis.Redis:
        # The reply reader starts with the first request, whether or not Redis answers then: it
        # waits for Redis on its own, and every later request needs it.
        if self._dispatcher is None:
            self._dispatcher = asyncio.create_task(self._dispatch())
        if self._redis is None:
            self._redis = aioredis.Redis.from_url(self.settings.redis_url)
        return self._redis

    async def _dispatch(self) -> None:
        """One reader of this entry's reply list hands each answer to the request awaiting it:
        every answer there at once, so that the requests a batch answered send their next steps
        together (frontend/step_sender.py). Both reads go in one round trip: Redis runs the
        second as soon as the first returns."""
        r = aioredis.Redis.from_url(self.settings.redis_url)
        while True:
            try:
                item, rest = await r.pipeline(transaction=False).blpop([self.reply_key], timeout=1).lpop(
                    self.reply_key, REPLIES_AT_ONCE).execute()
            except (aioredis.RedisError, OSError) as exc:
                log.warning("reply reader: %s", exc)
                await asyncio.sleep(0.5)
                continue
            for raw in ([item[1]] if item is not None else []) + (rest or []):
                self._answer(raw)

    def _answer(self, raw: bytes) -> None:
        try:
            header, tensors = unpack(raw)
        except BadRequest as exc:
            log.error("unreadable reply dropped: %s", exc)
            return
        future = self._pending.get(header.request_id)
        # No one waiting: the request timed out or ended, or this is a duplicate of reclaimed work.
        if future is not None and not future.done():
            if header.next_step:  # sent on by the last stage: answered before the request asks for it
                self._pending.setdefault(header.next_step, asyncio.get_running_loop().create_future())
            future.set_result((header, tensors))


def _checked(reply: tuple[Header, dict]) -> tuple[Header, dict]:
    header, out = reply
    if header.error is not None:
        raise StageFailed(header.status, header.error, header.retry_after)
    return header, out
