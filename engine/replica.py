"""A stage replica's engine loop, in vLLM v1's shape (`EngineCore.step`: schedule, execute,
update): each turn it gathers the next batch from its transport (engine/transport.py:
Redis in and out), runs it (the runner for single passes; `GenerationStage` for a generative
model, with its KV cache), and hands every output on by the stage graph (engine/routes.py)
in the same transaction that acknowledges what it took. A second thread keeps the replica's
registration, its CPUs and its items in hand alive.

A replica of a generative model also reads its own stream: the decode steps of the requests whose
KV cache it holds (it ran their prefill). It runs everything ready as one batch per step
(continuous batching), decode steps first. Being drained, it stops taking new requests and, by
QUART_DRAIN, either hands each cache it holds to a peer of its stage with the request's next step
(`migrate`) or finishes the requests (`finish`), then exits."""
from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from prometheus_client import Counter, Gauge, Histogram

from contracts.config import Settings
from contracts.proc_stat import started_at
from contracts.stage import StageRef
from contracts.stage_graph import Edges, chain
from contracts.wire import BadRequest, Header, StageTiming, decode_tensors, encode_tensors
from engine.batch_policy import batch_limit, handover_peer, new_item_slots, still_fed
from engine.compile_policy import compile_may_start
from engine.generation_step import FIRST, HOLDER, INSTALL, NEXT, PEER, REPLY, GenerationStage, Outcome, Work
from engine.idle_cores import CoreBoard
from engine.routes import Routes
from engine.transport import Commit, Down, Refused, StageTransport, stream_gone
from models.batched_decoder import BatchedDecoder
from models.compile_worker import fill_cache
from models.compiled_decode import compile_in_background
from models.decode_batches import FEW_ROWS
from models.emulated import EmulatedRunner
from models.fetch import ensure_manifest
from models.profiles import profile as emulation_profile
from models.serving_first import SERVING_FIRST
from models.shard_reader import ShardReader, start_readers
from models.shard_stream import stream_tensors
from models.stage_runner import StageRunner
from state.records import ColdStart, ReplicaRecord, StageSample
from state.store import Unavailable

log = logging.getLogger("quart.replica")

_LABELS = ("model", "stage")
REQUESTS = Counter("quart_stage_requests_total", "Work items finished by this replica", _LABELS + ("outcome",))
SERVICE = Histogram("quart_stage_service_seconds", "Compute time per work item", _LABELS)
QUEUE = Histogram("quart_stage_queue_seconds", "Time a work item waited in the stage's stream", _LABELS)
INFLIGHT = Gauge("quart_stage_inflight", "Work items being computed", _LABELS)
BATCH = Histogram("quart_stage_batch_size", "Work items run as one batch", _LABELS,
                  buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64))
MIGRATIONS = Counter("quart_stage_migrations_total", "KV caches moved between replicas of this stage",
                     _LABELS + ("direction",))
KV_BYTES = Gauge("quart_stage_kv_bytes", "KV-cache bytes reserved by the sequences this replica holds", _LABELS)
WAITING_POLL_MS = 50
# How often a draining replica looks up whether it must still read its stage's stream.
FED_CHECK_S = 0.25


def stage_graph(runner: StageRunner | EmulatedRunner) -> Edges:
    """An emulated model's graph is its profile's; a real model is a chain."""
    profile = getattr(runner.manifest, "profile", None)
    return profile.graph() if profile is not None else chain(runner.manifest.num_stages)


class StageReplica:
    def __init__(self, settings: Settings, stage: StageRef, started_by: str = "cold",
                 runner: StageRunner | None = None, readers: dict[int, ShardReader] | None = None) -> None:
        """`runner`: stages already loaded (inherited from a KeysManager zygote); else loads them,
        from `readers` when the caller started reading the shards already (before its imports)."""
        self.settings = settings
        first, last = stage.first, stage.last
        torch.set_num_threads(max(1, settings.compute.threads))
        if runner is None and settings.compute.emulate:
            runner = EmulatedRunner(emulation_profile(settings.compute.emulate), stage.model, first, last)
        self.coldstart: ColdStart | None = None
        if runner is None:
            runner = self._load(stage, readers)
            started_by = "cold"  # whatever started this process, it loaded the shard itself
        self.runner = runner
        self.manifest = runner.manifest
        self.stage = stage
        self.model, self.first, self.last = stage.model, first, last
        pid = os.getpid()
        self.info = ReplicaRecord(
            replica_id=f"{self.model}-s{stage.stages}.{settings.server}.{pid}", model=self.model,
            stage_start=first, stage_end=last, server=settings.server, pid=pid,
            device="emulated" if settings.compute.emulate else settings.compute.device, cpus=max(1, settings.compute.threads),
            started_by=started_by, started_at=time.time())
        self.routes = Routes(stage_graph(runner), first, last)
        generative = isinstance(runner, StageRunner) and runner.manifest.generative
        data = settings.data
        self.transport = StageTransport(
            settings.redis_url, stage, self.replica_id, generative, records_maxlen=data.records_maxlen,
            reply_ttl_ms=int(data.request_timeout_s * 2000), reclaim_idle_ms=data.reclaim_idle_ms,
            stream_ttl_ms=int(data.replica_ttl_s * 1000), on_first_work=self._first_work)
        self.store = self.transport.store
        self.generation = GenerationStage(runner, self.replica_id, settings.batching.kv_bytes,
                                          settings.batching.kv_wait_s, settings.limits) if generative else None
        self._labels = {"model": self.model, "stage": str(first)}
        self._stop = threading.Event()
        self._compute_lock = threading.Lock()
        self._stepped_at: float | None = None  # when the last step ended (monotonic)
        self._draining = False
        self._handed_over_at = float("-inf")  # when this replica last handed a sequence to a peer
        self._steps_without_new = 0
        self._next_reclaim = 0.0  # when the work loop next takes over what dead replicas held
        self._peer: tuple[str, str] | None = None
        self._peer_checked = 0.0
        self._fed = False
        self._fed_checked = float("-inf")
        self._fed_lock = threading.Lock()  # the work loop and stop() both ask
        self.first_work_at: float | None = None
        self._allowed_cpus = sorted(os.sched_getaffinity(0))
        self.cpus = max(1, settings.compute.threads)
        # CPUs the autoscaler asked for (quart:cpus:<stage>), and those this replica is pinned to
        # (None: not pinned, every allowed core; a replica at its default count still pins when asked).
        self._wanted_cpus: int | None = None
        self._pinned: int | None = None
        self._compile_asked: set[int] = set()  # thread counts whose decode step compiles or has compiled
        self._threads: list[threading.Thread] = []
        # Torch steps take the host's idle cores (engine/idle_cores.py); emulated ones have no threads.
        self._board = (CoreBoard(Path(settings.home) / "run" / "cores") if settings.compute.idle_prefills
                       and isinstance(runner, StageRunner) and settings.compute.device == "cpu" else None)

    def _compile(self, engine: BatchedDecoder, threads: list[int]) -> None:
        """Compiles the decode step for each of `threads` not compiled yet (a zygote compiles its
        forks' own count) in the background, below serving and once this replica idles
        (engine/compile_policy.py), from caches a worker process fills first (models/compile_worker.py)."""
        compiled = engine.compiled
        threads = [n for n in threads if n not in self._compile_asked and (compiled is None or not compiled.covers(n))]
        if not threads:
            return
        self._compile_asked.update(threads)
        compute, since = self.settings.compute, time.monotonic()

        def may_start() -> bool:  # never in a replica being removed: it would compile for nothing
            now, stepped = time.monotonic(), self._stepped_at
            return not self._draining and compile_may_start(
                now - since, None if stepped is None else now - stepped, self._holding(), compute.compile_defer_s)
        prepare = functools.partial(fill_cache, str(self.manifest.directory), self.first, self.last, compute.dtype,
                                    threads, compute.prepack) if compute.compile_worker else lambda: None
        compile_in_background(engine, compute.compile_nice, may_start, prepare, threads)

    def _step_threads(self) -> list[int]:
        """The thread counts this replica's decode steps run on, which it compiles: its own, and
        the host's cores where they take the idle ones (engine/idle_cores.py)."""
        idle = self._board is not None and self.settings.compute.idle_decodes
        return sorted({self.cpus} | ({self._board.cores} if idle else set()))

    @property
    def replica_id(self) -> str:
        return self.info.replica_id

    def _load(self, stage: StageRef, readers: dict[int, ShardReader] | None) -> StageRunner:
        """Streams the stages' shards in (or waits for them whole: QUART_STREAM_LOAD=false) and
        notes when each step of this cold start ended (time.time())."""
        settings = self.settings
        imported = time.time()
        readers = readers or start_readers(settings, stage)
        manifest = ensure_manifest(settings, stage.model, tokenizer=False)
        whole = not settings.coldstart.stream
        runner = StageRunner(manifest, stage.first, stage.last, settings.compute.device, settings.compute.dtype,
                             tensors=lambda i: stream_tensors(readers[i], whole_first=whole),
                             prepack=settings.compute.prepack, quantize=settings.compute.quantize)
        self.coldstart = ColdStart(process_at=started_at(), imported_at=imported, loaded_at=time.time(),
                                   fetch_started_at=min(r.started for r in readers.values()),
                                   fetched_at=max(r.finished for r in readers.values()),
                                   bytes=sum(r.info.bytes for r in readers.values()))
        log.info("%s stages [%d, %d) loaded from %s in %.2f s since the process started", stage.model, stage.first,
                 stage.last, ", ".join(sorted({r.where for r in readers.values()})),
                 self.coldstart.loaded_at - self.coldstart.process_at)
        return runner

    def start(self) -> None:
        if self.generation is not None and self.settings.compute.compiles:
            if (zygote := self.generation.engine.compiled) is not None:
                log.info("decode steps compiled by the zygote (in %.1f s)", zygote.compile_s)
            self._compile(self.generation.engine, self._step_threads())
        self.transport.ensure_streams(self.routes.next_stages)
        self.store.register(self.info, self.settings.data.replica_ttl_s)
        for target in (self._work_loop, self._heartbeat_loop):
            thread = threading.Thread(target=target, name=target.__name__, daemon=True)
            thread.start()
            self._threads.append(thread)
        log.info("replica %s serving %s stages [%d, %d)", self.replica_id, self.model, self.first, self.last)

    def stop(self) -> None:
        """Stops taking new work, finishes what it holds (the item in hand; the requests whose
        KV cache it holds, within the drain timeout), and leaves the registry. Until then it
        still takes what an earlier stage forwards where nobody else would (`_still_fed`)."""
        self._draining = True
        self.store.update_replica(self.replica_id, draining=True)  # peers do not migrate to it
        deadline = time.monotonic() + self.settings.data.drain_timeout_s
        while (self._holding() or self._still_fed()) and time.monotonic() < deadline and self.alive():
            time.sleep(0.05)
        if self.generation is not None:
            if self.generation.store.sequences:
                log.warning("%s stops holding %d sequences; their requests will prefill again elsewhere",
                            self.replica_id, len(self.generation.store.sequences))
            # An entry waiting on a step this replica handed over still names it in the step's
            # route, and takes it for lost (a prefill again) if it is gone at the entry's next
            # liveness check: stay registered until then, holding nothing.
            linger = self._handed_over_at + 2 * self.settings.data.reclaim_idle_ms / 1000.0
            while time.monotonic() < min(linger, deadline) and self.alive():
                time.sleep(0.05)
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()) + 1.0)
        self.store.deregister(self.info)
        self.transport.close(self.info.server)
        if self._board is not None and not any(t.is_alive() for t in self._threads):
            self._board.close()
        log.info("replica %s stopped", self.replica_id)

    def _holding(self) -> bool:
        return self.generation is not None and bool(self.generation.store.sequences)

    def _still_fed(self) -> bool:
        """batch_policy.still_fed for this replica, read from the registry at most every
        FED_CHECK_S: replicas reading this stage's stream that are not draining, replicas of
        earlier stages that may forward to it, items waiting in it. False while Redis is down
        (nothing can arrive then). A caller that comes while another reads waits for that answer,
        never the one before it."""
        with self._fed_lock:
            if time.monotonic() - self._fed_checked < FED_CHECK_S:
                return self._fed
            try:
                live = self.store.live_among([(self.model, s) for s in range(self.first + 1)])
                unread = self.store.backlog(self.model, self.first).waiting
                readers = sum(x.stage_start == self.first and not x.draining and x.replica_id != self.replica_id
                              for x in live[(self.model, self.first)])
                upstream = {x.replica_id for s in range(self.first) for x in live[(self.model, s)]
                            if x.stage_end <= self.first}
                self._fed = still_fed(readers, len(upstream), unread)
            except Down:
                self._fed = False
            self._fed_checked = time.monotonic()
            return self._fed

    def _give_back_waiting(self) -> None:
        """Prefills waiting here for KV room go back to the shared stream for other replicas
        (a draining replica takes no new ones)."""
        waiting, self.generation.waiting = self.generation.waiting, []
        self.transport.give_back(waiting)

    # -- the work loop -------------------------------------------------------------------------

    def _work_loop(self) -> None:
        next_expiry = 0.0
        while not self._stop.is_set():
            try:
                if self._wanted_cpus is not None and self._wanted_cpus != self._pinned:
                    self._apply_cpus(self._wanted_cpus)
                # A turn whose items the last commit took reclaims at the next (that commit took none).
                reclaim = time.monotonic() >= self._next_reclaim and self.transport.taken is None
                if reclaim:
                    self._next_reclaim = time.monotonic() + self.settings.data.reclaim_idle_ms / 2000.0
                if self._draining and self.generation is not None and self.generation.waiting and not self._still_fed():
                    self._give_back_waiting()
                works = self._gather(reclaim)
                with SERVING_FIRST.turn():  # a background compile waits (models/serving_first.py)
                    if self.generation is None:
                        for work in works:
                            self._process(work)
                    elif works or self.generation.waiting:
                        self._run_generation(works)
                if self.generation is not None and time.monotonic() >= next_expiry:
                    next_expiry = time.monotonic() + 1.0
                    for seq in self.generation.evict_idle(self.settings.data.request_timeout_s):
                        log.info("%s freed idle sequence %s", self.replica_id, seq)
            except Down as exc:  # Redis down or loading its file: wait for it
                log.warning("redis unavailable (%s); retrying", exc)
                self.transport.lost_turn({(w.stream, w.msg_id) for w in self.generation.waiting} if self.generation else set())
                self._stop.wait(0.5)
            except Refused as exc:
                if not stream_gone(exc):
                    raise
                log.warning("%s: a stream or group is gone (%s); creating them again", self.replica_id, exc)
                self.transport.ensure_streams(self.routes.next_stages)
            except Exception:  # the loop must outlive any one bad turn
                log.exception("%s: work loop error; continuing", self.replica_id)
                self._stop.wait(0.5)
        self._give_back_taken()

    def _give_back_taken(self) -> None:
        """What the last commit took for a turn that will not come goes back to the stage's stream
        (a decode step there finds no cache and is answered lost: the entry prefills again, as
        when a replica dies, without waiting for the reclaim)."""
        taken, self.transport.taken = self.transport.taken, None
        try:
            self.transport.give_back(taken or [])
        except Down as exc:  # what Redis still holds pending is reclaimed from there
            log.warning("%s could not give back what it took (%s)", self.replica_id, exc)

    def alive(self) -> bool:
        """Started, and both its threads still running (the watchdog's health check)."""
        return bool(self._threads) and all(t.is_alive() for t in self._threads)

    def _gather(self, reclaim: bool) -> list[Work]:
        """The next batch: decode steps and frees first (the private stream), then as many new
        items of the shared stream as there are slots, at least one every few steps so prefills
        never starve; blocks briefly only when there is nothing at all."""
        t = self.transport
        if t.redeliver:
            again = t.pending_again(self.settings.batching.max_batch)
            if again:
                return again
        if self.generation is None:
            return (t.claim_abandoned() if reclaim else []) or t.read({t.shared: ">"}, 1, self.settings.data.block_ms)
        max_batch, slots = self._take_args()
        take_new = any(slots)
        works, t.taken = t.taken, None  # what the last commit took for this turn, if it did
        if works is None and reclaim and take_new:
            # Once a reclaim period, an item a dead replica held goes before the stage's new ones.
            works = t.take(max_batch, [0] * len(slots))
            if slots[len(works)] > 0:
                works += t.claim_abandoned() or t.read({t.shared: ">"}, slots[len(works)], None)
        elif works is None:
            works = t.take(max_batch, slots)
        if not works:
            # Prefills waiting for room are retried as soon as a free (or anything) arrives.
            streams = {t.private: ">", t.shared: ">"} if take_new else {t.private: ">"}
            works = t.wait_for_work(streams, max_batch, slots,
                                    WAITING_POLL_MS if self.generation.waiting else self.settings.data.block_ms)
        self._steps_without_new = 0 if any(w.stream == t.shared for w in works) else self._steps_without_new + 1
        return works

    def _take_args(self) -> tuple[int, list[int]]:
        """A turn's take (StageTransport.take): the batch (batch_policy.batch_limit), and the new
        items that join it beside each number of decode steps (none while prefills wait for room
        or the replica drains and is not the stage's last reader)."""
        few_rows = self.settings.compute.compiles and isinstance(self.runner, StageRunner) and self.runner.layout == "packed"
        max_batch = batch_limit(self.settings.batching.max_batch, FEW_ROWS if few_rows else None)
        take_new = (not self._draining or self._still_fed()) and not self.generation.waiting
        return max_batch, [new_item_slots(max_batch, n, self._steps_without_new) if take_new else 0
                           for n in range(max_batch + 1)]

    def _next_take(self) -> tuple[int, list[int]] | None:
        """The next turn's take, for this turn's commit to run; None when that turn reclaims or
        this replica drains (both ask more of Redis than one take)."""
        if self._draining or time.monotonic() >= self._next_reclaim:
            return None
        return self._take_args()

    def _first_work(self) -> None:
        """When a new replica took its first work: what scale-up latency is measured to."""
        self.first_work_at = time.time()
        self.store.update_replica(self.replica_id, first_work_at=self.first_work_at,
                                  **({"coldstart": self.coldstart} if self.coldstart else {}))
        if self.coldstart:
            self.store.record_cold_start(self.stage, self.coldstart)

    def _process(self, work: Work) -> None:
        """One single-pass item (embeddings, emulated stages): compute and hand it on."""
        header = work.header
        if work.received > header.deadline:
            REQUESTS.labels(**self._labels, outcome="expired").inc()
            self.transport.commit().execute([work])
            return
        tensors, join_of = work.tensors, self.routes.join_of
        if join_of:
            try:
                header, parts = self.transport.joins.collect(header, join_of)
                tensors = self.runner.join(parts)
            except BadRequest as exc:
                header.error, header.status = f"stage {self.first}: {exc}", exc.status
        out = self._compute(header, tensors) if header.error is None else {}
        service_ms = (time.time() - work.received) * 1000.0
        commit = self.transport.commit()
        self._record(commit, work, service_ms, 1)
        self.routes.forward(commit, header, out)
        if join_of:
            commit.joined(header, self.first)
        commit.execute([work])

    def _run_generation(self, works: list[Work]) -> None:
        """One continuous-batching step: every decode, free and admitted prefill of `works` (and
        the prefills still waiting for room) in one forward, each output handed on."""
        now = time.time()
        live = [w for w in works if w.header.kind == "free" or now <= w.header.deadline]
        expired = [w for w in works if w not in live]
        for _ in expired:
            REQUESTS.labels(**self._labels, outcome="expired").inc()
        INFLIGHT.labels(**self._labels).inc()
        peer = self._handover_peer() if self._draining and self.settings.batching.drain == "migrate" else None
        MIGRATIONS.labels(**self._labels, direction="in").inc(sum(w.header.kind in ("adopt", "install") for w in live))
        try:
            batch = self.generation.waiting + [w for w in live if w not in self.generation.waiting]
            kinds = {w.header.kind for w in batch}
            # A prefill never runs compiled: its step may take idle cores no compiled graph covers.
            # Frees compute nothing: the entry sends a sequence's to every holder at once, and on
            # the board they would look like steps overlapping and keep the next request's
            # prefill off the idle cores.
            with self._computing(eager="prefill" in kinds, computes=kinds != {"free"}):
                result = self.generation.run(batch, peer)
        finally:
            INFLIGHT.labels(**self._labels).dec()
        if result.batch:
            BATCH.labels(**self._labels).observe(result.batch)
            SERVICE.labels(**self._labels).observe(result.service_s)
        KV_BYTES.labels(**self._labels).set(self.generation.store.used)
        commit = self.transport.commit()
        holders: list[tuple[int | None, Outcome]] = []
        per_item_ms = result.service_s * 1000.0 / max(1, result.batch)
        for o in result.outcomes:
            if o.handed_on:  # `stop` lingers while the entry's route may still name this replica
                self._handed_over_at = time.monotonic()
            if o.to in (PEER, INSTALL):  # a migration (the step runs at the peer, which records it), a gather
                MIGRATIONS.labels(**self._labels, direction="out").inc()
            # Not a fork (a cache copied, no step run) nor the next step (recorded with its answer).
            elif o.header.kind != "fork" and o.to != FIRST:
                REQUESTS.labels(**self._labels, outcome="error" if o.header.error else "ok").inc()
                self._record(commit, o.work, per_item_ms, result.batch, result.compiled)
            replica = {PEER: o.peer, INSTALL: o.peer, HOLDER: o.header.route.get(str(self.last)),
                       FIRST: o.header.route.get("0")}.get(o.to)
            if replica:
                # Refused (None) if that replica's stream is gone: checked once the commit has run.
                holders.append((commit.to_replica(replica, o.header, o.tensors), o))
            elif o.to == NEXT:
                self.routes.forward(commit, o.header, o.tensors)
            elif o.to == REPLY:
                commit.reply(o.header, o.tensors)
            else:
                holders.append((None, o))  # a step for a holder the route does not name
        results = commit.execute(result.done + expired, then_take=self._next_take())
        lost = [o for index, o in holders if index is None or results[index] is None]
        if lost:
            # The replica holding the next stage's cache (or the peer taking one over) is gone:
            # the entry prefills again.
            commit = self.transport.commit()
            for o in lost:
                o.header.kind = "lost"
                commit.reply(o.header, {})
            commit.execute([])

    def _handover_peer(self) -> tuple[str, str] | None:
        """Where this draining replica's sequences go, and how: a live, not draining replica
        starting at this stage (batch_policy.handover_peer chooses)."""
        now = time.monotonic()
        if now - self._peer_checked > 1.0:
            self._peer_checked = now
            self._peer = handover_peer(self.last, {
                x.replica_id: (x.stage_end, x.sequences) for x in self.store.live_replicas(self.model, self.first)
                if x.replica_id != self.replica_id and x.stage_start == self.first and not x.draining})
        return self._peer

    def _record(self, commit: Commit, work: Work, service_ms: float, batch: int, compiled: bool = False) -> None:
        header = work.header
        queue_ms = work.queued_s * 1000.0
        header.timings.append(StageTiming(self.first, self.replica_id, round(queue_ms, 3), round(service_ms, 3)))
        QUEUE.labels(**self._labels).observe(queue_ms / 1000.0)
        sample = StageSample(header.request_id, work.received - work.queued_s, queue_ms, service_ms, self.replica_id,
                             header.kind, batch, compiled=compiled, threads=torch.get_num_threads())  # as the step left them
        commit.record(sample)
        if log.isEnabledFor(logging.DEBUG):   # every item of every step passes here: no work unless asked
            log.debug("%s %s at stage %d: queued %.1f ms, computed %.1f ms in a batch of %d", header.kind,
                      header.request_id, self.first, queue_ms, service_ms, batch, extra={"request_id": header.request})

    def _compute(self, header: Header, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        INFLIGHT.labels(**self._labels).inc()
        started = time.time()
        try:
            with self._computing(eager=True):  # a whole pass, as a prefill is
                out = self.runner.checked_run(tensors, self.settings.limits)
            REQUESTS.labels(**self._labels, outcome="ok").inc()
            return out
        except BadRequest as exc:
            header.error, header.status = f"stage {self.first}: {exc}", exc.status
        except Exception as exc:  # a failing request must not take the replica down
            log.exception("%s failed on %s", self.replica_id, header.request_id, extra={"request_id": header.request})
            header.error, header.status = f"stage {self.first} failed: {exc}", 500
        finally:
            INFLIGHT.labels(**self._labels).dec()
            SERVICE.labels(**self._labels).observe(time.time() - started)
        REQUESTS.labels(**self._labels, outcome="error").inc()
        return {}

    # -- CPUs ----------------------------------------------------------------------------------

    @contextmanager
    def _computing(self, eager: bool = False, computes: bool = True) -> Iterator[None]:
        """The compute lock, and the threads of this step: the host's idle cores, at least this
        replica's own, unless the autoscaler pinned it to cores of its own. An `eager` step (a
        prefill) takes them; a decode step only where QUART_IDLE_CORES=all and a compiled graph
        serves that count (`_compiled_for`); one that `computes` nothing stays off the
        board. A step that takes only its own still marks the board: another's that starts beside
        it must not take every core."""
        with self._compute_lock:
            try:
                if self._board is None or self._pinned is not None or not computes:
                    yield
                else:
                    threads = self._board.begin(self.cpus)
                    # A compiled step on its own cores beats an eager one on all.
                    if not eager and not (self.settings.compute.idle_decodes and self._compiled_for(threads)):
                        threads = self.cpus
                    if threads != torch.get_num_threads():
                        torch.set_num_threads(threads)
                    try:
                        yield
                    finally:
                        self._board.end()
            finally:
                self._stepped_at = time.monotonic()  # the compile's turn waits for a pause (_compile)

    def _compiled_for(self, threads: int) -> bool:
        """Whether a decode step on `threads` threads runs compiled: only then does it take the
        idle cores. Eager decode steps keep their own (before the compile, or without it): on two
        threads of the 2-core EPYC they were no faster than on one, and slower while OpenMP's
        threads spun (SmolLM2 in 4 stages, 69-79 ms a token against 67-69; 2026-12-06)."""
        compiled = self.generation.engine.compiled if self.generation is not None else None
        return compiled is not None and compiled.covers(threads)

    def _apply_cpus(self, cpus: int) -> None:
        """Changes this replica's CPUs while it runs: the affinity of every thread of the process
        and torch's thread count (emulated stages scale their service time instead), on cores
        the server's other pinned replicas do not hold where enough are free."""
        cores = self.transport.claim_cores(self.info.server, self._allowed_cpus, cpus)
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), cores)
            except (ProcessLookupError, PermissionError):
                pass
        self.runner.use_cpus(len(cores))
        self.cpus = self._pinned = cpus
        if self.generation is not None and self.settings.compute.compiles:
            self._compile(self.generation.engine, [len(cores)])  # eager on the new count until then
        self.store.update_replica(self.replica_id, cpus=cpus)
        log.info("%s now uses %d CPUs (cores %s)", self.replica_id, cpus, cores)

    # -- liveness ------------------------------------------------------------------------------

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.settings.data.heartbeat_s):
            try:
                self.store.heartbeat(self.info, self.settings.data.replica_ttl_s)
                wanted = self.store.stage_cpus(self.stage)
                if wanted is not None and wanted >= 1:   # a container's fractional quota is the provider's
                    self._wanted_cpus = int(wanted)
                self.transport.keep_alive()
                if self.generation is not None:
                    self.store.update_replica(self.replica_id, kv_bytes=self.generation.store.used,
                                              sequences=len(self.generation.store.sequences))
            except Unavailable as exc:  # the heartbeat must outlive Redis going away
                log.warning("heartbeat failed: %s", exc)

    # -- direct invoke -------------------------------------------------------------------------

    def invoke(self, body: bytes) -> bytes:
        """Runs this replica's stages on safetensors bytes and answers safetensors bytes."""
        tensors = decode_tensors(body)
        with self._compute_lock:
            out = self.runner.checked_run(tensors, self.settings.limits)
        return encode_tensors(out)
