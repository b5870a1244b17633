"""The entry's writes to the stages' streams, coalesced: every step that the entry's requests
send in the same turns of the event loop leaves in one transaction.

Why: a stage runs whatever its stream holds as one batch. The last stage answers a batch's
requests together, and each request then sends its next decode step on its own; one XADD at a
time, the first stage wakes for the first step and runs it alone, then the rest, and the batch
splits. Every extra group costs a read of the stage's weights per token (a decode step is
memory-bound), so a split batch makes fewer tokens from the same cores. Sent in one
transaction, the steps reach the stream together and stay one batch."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis

from contracts.wire import MESSAGE_FIELD

# Turns of the event loop a flush waits for more sends once none came in a turn: a reply wakes
# its request through a few callbacks (the reader's future, shield, wait_for), so the requests a
# batch of replies woke send over more than one turn.
QUIET_TURNS = 3
# At most this many turns in all: a steady trickle of sends must not hold the first one back.
MAX_TURNS = 32


class StepSender:
    def __init__(self, connection: Callable[[], Awaitable[aioredis.Redis]]) -> None:
        self._connection = connection
        self._queued: list[tuple[str, bytes, bool, asyncio.Future]] = []
        self._flushing: asyncio.Task | None = None

    async def xadd(self, stream: str, message: bytes, nomkstream: bool) -> bytes | None:
        """Adds `message` to `stream` with the others sent meanwhile; its entry id, or None where
        `nomkstream` and the stream is gone. Raises what the transaction raised (Redis down)."""
        done = asyncio.get_running_loop().create_future()
        self._queued.append((stream, message, nomkstream, done))
        if self._flushing is None:
            self._flushing = asyncio.create_task(self._flush())
        return await done

    async def _flush(self) -> None:
        quiet = turns = 0
        while quiet < QUIET_TURNS and turns < MAX_TURNS:
            seen = len(self._queued)
            await asyncio.sleep(0)
            quiet = quiet + 1 if len(self._queued) == seen else 0
            turns += 1
        batch, self._queued, self._flushing = self._queued, [], None
        try:
            r = await self._connection()
            pipe = r.pipeline(transaction=True)
            for stream, message, nomkstream, _ in batch:
                pipe.xadd(stream, {MESSAGE_FIELD: message}, nomkstream=nomkstream)
            results = await pipe.execute(raise_on_error=False)  # a refused XADD fails its sender alone
        except BaseException as exc:  # each sender sees the failure (and may send again)
            for *_, done in batch:
                if not done.done():
                    done.set_exception(exc if isinstance(exc, Exception) else ConnectionError(str(exc)))
            if not isinstance(exc, Exception):
                raise
            return
        for (*_, done), result in zip(batch, results):
            if done.done():
                continue
            if isinstance(result, Exception):
                done.set_exception(result)
            else:
                done.set_result(result)
