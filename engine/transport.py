"""A stage replica's transport: everything it exchanges over Redis, and nothing it computes. Work
comes in from the stage's stream through the shared consumer group (and, for a generative model,
from the replica's own stream: the steps of the sequences whose cache it holds); what a step
produces leaves in one transaction with its records and the acknowledgements of what it took
(`Commit`), so that a hand-off and its acknowledgement both happen or neither does. Items left
pending by a dead replica are claimed again after an idle time; a replica's own unacknowledged
items are taken again after Redis comes back. The engine loop (engine/replica.py) sees `Work`
in and a `Commit` out, and the two exceptions below."""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import redis
import torch

from contracts.stage import StageRef
from contracts.wire import MESSAGE_FIELD, BadRequest, Header, pack, unpack
from engine.cpu_sets import pick_cores
from engine.generation_step import Work
from engine.join import Joins
from state import keys
from state.records import StageSample
from state.store import RedisStore

log = logging.getLogger("quart.replica")

# Redis is down or loading its file: wait for it (what this turn took is taken again after).
Down = redis.ConnectionError
# Redis refused a command: a stream or its group vanished (`stream_gone`), or worse.
Refused = redis.ResponseError


def stream_gone(exc: Refused) -> bool:
    """A stream or its consumer group vanished (a Redis that came back without them)."""
    return "NOGROUP" in str(exc)


def ensure_group(r: redis.Redis, stream: str) -> None:
    """Creates a stream and its consumer group if they do not exist yet."""
    try:
        r.xgroup_create(stream, keys.GROUP, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


# A turn's two non-blocking reads as one script (StageTransport.take). KEYS: the private stream,
# the shared one; ARGV: the group, the consumer, the private read's count, then the shared read's
# count for each number of items the private read took (0, 1, ...).
_TAKE = """
local function read(stream, count)
  if count <= 0 then return {} end
  local answer = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', count, 'STREAMS', stream, '>')
  if answer then return answer[1][2] end
  return {}
end
local private = read(KEYS[1], tonumber(ARGV[3]))
return {private, read(KEYS[2], tonumber(ARGV[4 + #private]))}
"""


class Commit:
    """One step's writes, in one transaction: hand-offs, records, replies, acknowledgements."""

    def __init__(self, transport: StageTransport) -> None:
        self._t = transport
        self._pipe = transport.redis.pipeline(transaction=True)

    def record(self, sample: StageSample) -> None:
        self._pipe.xadd(keys.records_stream(self._t.stage.model, self._t.stage.first), sample.encode(),
                        maxlen=self._t.records_maxlen, approximate=True)

    def to_stage(self, stage: int, header: Header, tensors: dict[str, torch.Tensor]) -> None:
        self._pipe.xadd(keys.stage_stream(self._t.stage.model, stage), {MESSAGE_FIELD: pack(header, tensors)})

    def part(self, header: Header, tensors: dict[str, torch.Tensor], source: int, parts: int) -> None:
        """A join's part (engine/join.py): the last of `parts` queues the request at the join."""
        self._t.joins.send_part(self._pipe, header, tensors, source, parts)

    def joined(self, header: Header, stage: int) -> None:
        self._t.joins.done(self._pipe, header, stage)

    def to_replica(self, replica: str, header: Header, tensors: dict[str, torch.Tensor]) -> int:
        """To a replica's own stream; refused if that stream is gone (the replica is). Returns
        the index of the write, whose result `execute` gives (None: refused)."""
        index = len(self._pipe.command_stack)
        self._pipe.xadd(keys.replica_stream(replica), {MESSAGE_FIELD: pack(header, tensors)}, nomkstream=True)
        return index

    def reply(self, header: Header, tensors: dict[str, torch.Tensor]) -> None:
        # At the tail: the entry reads from the head, so a sequence's answers reach it in order
        # (the one that names the next step before that step's own).
        self._pipe.rpush(header.reply_to, pack(header, tensors))
        self._pipe.pexpire(header.reply_to, self._t.reply_ttl_ms)

    def execute(self, works: list[Work], then_take: tuple[int, Sequence[int]] | None = None) -> list:
        """Acknowledges `works` with the rest and runs it all; each write's result. With
        `then_take` (`StageTransport.take`'s arguments), the next turn's items are taken in the
        same transaction, after its writes, into `StageTransport.taken`: one round trip where
        there were two."""
        for w in works:
            self._pipe.xack(w.stream, keys.GROUP, w.msg_id)
            self._pipe.xdel(w.stream, w.msg_id)
        if then_take is not None:
            # EVAL, not the registered script's EVALSHA: redis-py asks SCRIPT EXISTS before every
            # pipeline that holds one, a round trip of its own.
            self._pipe.eval(_TAKE, 2, self._t.private, self._t.shared, *self._t.take_args(*then_take))
        results = self._pipe.execute(raise_on_error=False)
        if then_take is not None:
            taken = results.pop()
            # A stream gone: the next turn's own take raises it.
            self._t.taken = None if isinstance(taken, Exception) else self._t.taken_works(taken)
        for result in results:
            if isinstance(result, Exception):
                raise result
        for w in works:
            self._t.holding.discard((w.stream, w.msg_id))
        return results


class StageTransport:
    def __init__(self, redis_url: str, stage: StageRef, replica_id: str, private: bool, *, records_maxlen: int,
                 reply_ttl_ms: int, reclaim_idle_ms: int, stream_ttl_ms: int,
                 on_first_work: Callable[[], None]) -> None:
        """`private`: the replica also reads its own stream (a generative model's steps);
        `on_first_work`: called once, when the replica takes its first item."""
        self.redis = redis.Redis.from_url(redis_url)
        self.store = RedisStore(self.redis)
        self.stage, self.replica_id = stage, replica_id
        self.shared = keys.stage_stream(stage.model, stage.first)
        self.private = keys.replica_stream(replica_id) if private else None
        self.joins = Joins(self.redis, stage.model, reply_ttl_ms)
        self.records_maxlen, self.reply_ttl_ms = records_maxlen, reply_ttl_ms
        self.reclaim_idle_ms, self.stream_ttl_ms = reclaim_idle_ms, stream_ttl_ms
        # Taken and not yet acknowledged: (stream, message id), as two streams' ids can be the same.
        self.holding: set[tuple[str, bytes]] = set()
        self.redeliver = False  # Redis went away mid-turn: take this replica's unacknowledged items again
        self._on_first_work: Callable[[], None] | None = on_first_work
        self._take = self.redis.register_script(_TAKE)
        # The next turn's items, taken with the last commit (Commit.execute's `then_take`); None: not taken.
        self.taken: list[Work] | None = None

    def ensure_streams(self, next_stages: list[int]) -> None:
        """The streams this replica reads and writes, with their consumer groups: at start, and
        again after a Redis that came back without them."""
        ensure_group(self.redis, self.shared)
        for stage in next_stages:
            ensure_group(self.redis, keys.stage_stream(self.stage.model, stage))
        if self.private is not None:
            ensure_group(self.redis, self.private)
            self.redis.pexpire(self.private, self.stream_ttl_ms)

    def commit(self) -> Commit:
        return Commit(self)

    # -- taking work -----------------------------------------------------------------------------

    def read(self, streams: dict[str, str], count: int, block: int | None) -> list[Work]:
        answer = self.redis.xreadgroup(keys.GROUP, self.replica_id, streams, count=count, block=block)
        return self._works(answer)

    def take(self, max_batch: int, slots: Sequence[int]) -> list[Work]:
        """A turn's items without blocking, in one round trip: up to `max_batch` of the private
        stream's, then as many of the shared stream's as `slots[n]` says for the n taken from the
        private one (the caller's rule, batch_policy.new_item_slots, for every n: the rule stays
        in Python, where the simulator runs it too). A generative replica reads both streams every
        turn; two reads were two round trips, each a switch to Redis and back on a busy host."""
        return self.taken_works(self._take([self.private, self.shared], self.take_args(max_batch, slots)))

    def take_args(self, max_batch: int, slots: Sequence[int]) -> list:
        return [keys.GROUP, self.replica_id, max_batch, *slots]

    def taken_works(self, answer: list) -> list[Work]:
        """The take script's answer (each stream's entries as id, [field, value, ...]) as work items."""
        private, shared = answer
        return [w for stream, entries in ((self.private, private), (self.shared, shared)) for msg_id, flat in entries
                if (w := self._work(stream, msg_id, dict(zip(flat[::2], flat[1::2])))) is not None]

    def wait_for_work(self, streams: dict[str, str], max_batch: int, slots: Sequence[int], block_ms: int) -> list[Work]:
        """Blocks up to `block_ms` for an item on `streams`; with it, the rest of the turn as `take`
        reads it (`max_batch` and `slots` as there, the woken item counted as one of the batch).
        What wakes an idle replica is mostly the first of a batch that the stage before (or the
        entry) handed on in one transaction: a prefill burst on the shared stream as much as
        decode steps on the private one. Taken one by one, the batch would split into a step of
        one and a step of the rest, and stay split through every later stage, each group reading
        the stage's weights once a token. Both go in one round trip: Redis runs the take as soon
        as the read returns."""
        if self.private is None or max_batch <= 1:
            return self.read(streams, 1, block_ms)
        pipe = self.redis.pipeline(transaction=False)
        pipe.xreadgroup(keys.GROUP, self.replica_id, streams, count=1, block=block_ms)
        # After a woken item of either stream, n of the private one leave the slots that n + 1
        # decode steps leave (new_item_slots counts the woken prefill as a slot taken).
        pipe.eval(_TAKE, 2, self.private, self.shared, *self.take_args(max_batch - 1, slots[1:]))
        woken, rest = pipe.execute()
        return self._works(woken) + self.taken_works(rest)   # what the take took is taken, woken or not

    def pending_again(self, count: int) -> list[Work]:
        """This replica's own unacknowledged items (XREADGROUP from id 0), less those in hand."""
        streams = {self.shared: "0", **({self.private: "0"} if self.private is not None else {})}
        in_hand = set(self.holding)
        answer = self.redis.xreadgroup(keys.GROUP, self.replica_id, streams, count=count)
        works = []
        for stream, entries in answer or []:
            for msg_id, fields in entries:
                if not fields:  # deleted meanwhile
                    self.redis.xack(stream, keys.GROUP, msg_id)
                elif (stream.decode(), msg_id) not in in_hand and (w := self._work(stream.decode(), msg_id, fields)) is not None:
                    works.append(w)
        self.redeliver = bool(works)  # more may be pending beyond this read
        if works:
            log.info("%s takes %d unacknowledged item(s) again after Redis came back", self.replica_id, len(works))
        return works

    def claim_abandoned(self) -> list[Work]:
        """Takes over one item that a dead replica held for longer than the reclaim idle time."""
        _, entries, *_ = self.redis.xautoclaim(self.shared, keys.GROUP, self.replica_id,
                                               min_idle_time=self.reclaim_idle_ms, start_id="0-0", count=1)
        for msg_id, fields in entries:
            if fields:
                log.info("%s reclaimed %s", self.replica_id, msg_id.decode())
                work = self._work(self.shared, msg_id, fields)
                return [work] if work is not None else []
            self.redis.xack(self.shared, keys.GROUP, msg_id)  # deleted meanwhile
        return []

    def lost_turn(self, in_hand: set[tuple[str, bytes]]) -> None:
        """What this turn took was neither handed on nor acknowledged (the transaction did not
        run): it is still pending for this replica in Redis, and is taken again from there once
        Redis answers; `in_hand`: the items the engine keeps meanwhile (stream, message id)."""
        self.holding &= in_hand
        self.taken = None
        self.redeliver = True

    def give_back(self, works: list[Work]) -> None:
        """Items this replica took and will not run go back to the stage's stream for others."""
        if works:
            commit = self.commit()
            for w in works:
                commit.to_stage(self.stage.first, w.header, w.tensors)
            commit.execute(works)

    def _works(self, answer: list | None) -> list[Work]:
        """XREADGROUP's answer (as redis-py parses it) as work items."""
        return [w for stream, entries in answer or [] for msg_id, fields in entries
                if (w := self._work(stream.decode(), msg_id, fields)) is not None]

    def _work(self, stream: str, msg_id: bytes, fields: dict) -> Work | None:
        """A message as a work item; None for an unreadable one, dropped loudly (without a
        readable header there is nobody to answer)."""
        self.holding.add((stream, msg_id))
        if self._on_first_work is not None:
            first, self._on_first_work = self._on_first_work, None
            first()
        try:
            header, tensors = unpack(fields[MESSAGE_FIELD])
        except (BadRequest, KeyError, TypeError) as exc:
            log.error("%s dropped unreadable message %s: %s", self.replica_id, msg_id, exc)
            self.commit().execute([Work(stream, msg_id, None, {})])
            return None
        return Work(stream, msg_id, header, tensors)

    # -- liveness and leaving --------------------------------------------------------------------

    def keep_alive(self) -> None:
        """Resets the idle time of the shared stream's items in hand, so that long work (or a
        prefill waiting for KV room) is not reclaimed from a replica that is alive; keeps the
        private stream from expiring."""
        held = [m for stream, m in list(self.holding) if stream == self.shared]
        if held:
            self.redis.xclaim(self.shared, keys.GROUP, self.replica_id, 0, held, justid=True)
        if self.private is not None:
            self.redis.pexpire(self.private, self.stream_ttl_ms)

    def close(self, server: str) -> None:
        if self.private is not None:
            self.redis.delete(self.private)
        self.redis.hdel(keys.cpu_sets(server), self.replica_id)

    def claim_cores(self, server: str, allowed: list[int], cpus: int) -> list[int]:
        """Picks and records this replica's cores in the server's hash of pinned replicas (in a
        WATCH transaction: two replicas pinned at once do not pick the same free cores); entries
        of replicas that are gone are dropped on the way."""
        key = keys.cpu_sets(server)
        with self.redis.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(key)
                    held = {rid.decode(): v.decode() for rid, v in pipe.hgetall(key).items()
                            if rid.decode() != self.replica_id}
                    gone = [rid for rid in held if not pipe.exists(keys.replica(rid))]
                    others = [[int(c) for c in v.split(",")] for rid, v in held.items() if rid not in gone]
                    cores = pick_cores(allowed, others, cpus)
                    pipe.multi()
                    if gone:
                        pipe.hdel(key, *gone)
                    pipe.hset(key, self.replica_id, ",".join(map(str, cores)))
                    pipe.execute()
                    return cores
                except redis.WatchError:
                    continue
