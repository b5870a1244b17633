"""A stage replica: pulls work for its stage range from the stage's Redis Stream through the
shared consumer group, hands the output to the next stage (or the reply list), and only then
acknowledges. Work left pending by a dead replica is claimed again after an idle time."""
from __future__ import annotations

import logging
import os
import threading
import time

import redis
import torch
from prometheus_client import Counter, Gauge, Histogram

from contracts import keys
from contracts.config import Settings
from contracts.stage import StageRef
from contracts.wire import MESSAGE_FIELD, BadRequest, Header, StageTiming, decode_tensors, encode_tensors, pack, unpack
from pipeline.emulated import EmulatedRunner
from pipeline.emulated import profile as emulation_profile
from pipeline.manifest import Manifest
from pipeline.registry import ReplicaInfo, deregister, heartbeat, register
from pipeline.stage_runner import StageRunner

log = logging.getLogger("quart.replica")

_LABELS = ("model", "stage")
REQUESTS = Counter("quart_stage_requests_total", "Work items finished by this replica", _LABELS + ("outcome",))
SERVICE = Histogram("quart_stage_service_seconds", "Compute time per work item", _LABELS)
QUEUE = Histogram("quart_stage_queue_seconds", "Time a work item waited in the stage's stream", _LABELS)
INFLIGHT = Gauge("quart_stage_inflight", "Work items being computed", _LABELS)


def ensure_group(r: redis.Redis, stream: str) -> None:
    """Creates the stage's stream and consumer group if they do not exist yet."""
    try:
        r.xgroup_create(stream, keys.GROUP, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


class Replica:
    def __init__(self, settings: Settings, stage: StageRef, started_by: str = "cold",
                 runner: StageRunner | None = None) -> None:
        """`runner`: stages already loaded (inherited from a KeysManager zygote); else loads them."""
        self.settings = settings
        first, last = stage.first, stage.last
        torch.set_num_threads(max(1, settings.compute.threads))
        if runner is None and settings.compute.emulate:
            runner = EmulatedRunner(emulation_profile(settings.compute.emulate), stage.model, first, last)
        if runner is None:
            runner = StageRunner(Manifest.load(settings.model_dir(stage.model)), first, last, settings.compute.device,
                                 settings.compute.dtype)
            started_by = "cold"  # whatever started this process, it loaded the shard itself
        self.runner = runner
        self.manifest = runner.manifest
        self.stage = stage
        self.model, self.first, self.last = stage.model, first, last
        self.redis = redis.Redis.from_url(settings.redis.url)
        pid = os.getpid()
        self.info = ReplicaInfo(
            replica_id=f"{self.model}-s{stage.stages}.{settings.server}.{pid}", model=self.model,
            stage_start=first, stage_end=last, server=settings.server, pid=pid,
            device="emulated" if settings.compute.emulate else settings.compute.device, cpus=max(1, settings.compute.threads),
            started_by=started_by, started_at=time.time())
        self.stream = keys.stage_stream(self.model, first)
        self.next_stream = None if self.runner.is_last else keys.stage_stream(self.model, last)
        self._labels = {"model": self.model, "stage": str(first)}
        self._stop = threading.Event()
        self._compute_lock = threading.Lock()
        self._inflight: bytes | None = None
        self.first_work_at: float | None = None
        self._allowed_cpus = sorted(os.sched_getaffinity(0))
        self.cpus = max(1, settings.compute.threads)
        self._wanted_cpus = self.cpus
        self._threads: list[threading.Thread] = []

    @property
    def replica_id(self) -> str:
        return self.info.replica_id

    def start(self) -> None:
        ensure_group(self.redis, self.stream)
        if self.next_stream:
            ensure_group(self.redis, self.next_stream)
        register(self.redis, self.info, self.settings.data.replica_ttl_s)
        for target in (self._work_loop, self._heartbeat_loop):
            thread = threading.Thread(target=target, name=target.__name__, daemon=True)
            thread.start()
            self._threads.append(thread)
        log.info("replica %s serving %s stages [%d, %d)", self.replica_id, self.model, self.first, self.last)

    def stop(self) -> None:
        """Stops taking work, finishes the item in hand, and leaves the registry."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=self.settings.data.drain_timeout_s)
        deregister(self.redis, self.info)
        log.info("replica %s stopped", self.replica_id)

    # -- the work loop -------------------------------------------------------------------------

    def _work_loop(self) -> None:
        next_reclaim = 0.0
        while not self._stop.is_set():
            try:
                if self._wanted_cpus != self.cpus:
                    self._apply_cpus(self._wanted_cpus)
                entry = None
                if time.monotonic() >= next_reclaim:
                    entry = self._claim_abandoned()
                    next_reclaim = time.monotonic() + self.settings.data.reclaim_idle_ms / 2000.0
                if entry is None:
                    entry = self._read_new()
                if entry is not None:
                    self._process(*entry)
            except redis.ConnectionError as exc:
                log.warning("redis unavailable (%s); retrying", exc)
                self._stop.wait(0.5)
            except Exception:  # the loop must outlive any one bad turn
                log.exception("%s: work loop error; continuing", self.replica_id)
                self._stop.wait(0.5)

    def alive(self) -> bool:
        """Started, and both its threads still running (the watchdog's health check)."""
        return bool(self._threads) and all(t.is_alive() for t in self._threads)

    def _read_new(self) -> tuple[bytes, dict] | None:
        answer = self.redis.xreadgroup(keys.GROUP, self.replica_id, {self.stream: ">"},
                                       count=1, block=self.settings.data.block_ms)
        if not answer:
            return None
        return answer[0][1][0]

    def _claim_abandoned(self) -> tuple[bytes, dict] | None:
        """Takes over one item that a dead replica held for longer than the reclaim idle time."""
        _, entries, *_ = self.redis.xautoclaim(self.stream, keys.GROUP, self.replica_id,
                                               min_idle_time=self.settings.data.reclaim_idle_ms,
                                               start_id="0-0", count=1)
        for msg_id, fields in entries:
            if fields:
                log.info("%s reclaimed %s", self.replica_id, msg_id.decode())
                return msg_id, fields
            self.redis.xack(self.stream, keys.GROUP, msg_id)  # deleted meanwhile
        return None

    def _process(self, msg_id: bytes, fields: dict) -> None:
        self._inflight = msg_id
        started = time.time()
        if self.first_work_at is None:
            # When a new replica took its first work: what scale-up latency is measured to.
            self.first_work_at = started
            self.redis.hset(keys.replica(self.replica_id), "first_work_at", f"{started:.6f}")
        try:
            header, tensors = unpack(fields[MESSAGE_FIELD])
        except (BadRequest, KeyError, TypeError) as exc:
            # Without a readable header there is nobody to answer: drop it, loudly.
            log.error("%s dropped unreadable message %s: %s", self.replica_id, msg_id, exc)
            self._finish(msg_id, self.redis.pipeline(transaction=True))
            return
        if started > header.deadline:
            REQUESTS.labels(**self._labels, outcome="expired").inc()
            self._finish(msg_id, self.redis.pipeline(transaction=True))
            return
        out = self._compute(header, tensors)
        queue_ms = max(0.0, (started - header.enqueued_at) * 1000.0)
        service_ms = (time.time() - started) * 1000.0
        header.timings.append(StageTiming(self.first, self.replica_id, round(queue_ms, 3), round(service_ms, 3)))
        QUEUE.labels(**self._labels).observe(queue_ms / 1000.0)
        SERVICE.labels(**self._labels).observe(service_ms / 1000.0)
        pipe = self.redis.pipeline(transaction=True)
        self._hand_off(pipe, header, out)
        pipe.xadd(keys.records_stream(self.model, self.first),
                  {"id": header.request_id, "t": f"{header.enqueued_at:.6f}", "q": f"{queue_ms:.3f}",
                   "s": f"{service_ms:.3f}", "r": self.replica_id},
                  maxlen=self.settings.data.records_maxlen, approximate=True)
        self._finish(msg_id, pipe)

    def _compute(self, header: Header, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        INFLIGHT.labels(**self._labels).inc()
        try:
            with self._compute_lock:
                out = self.runner.checked_run(tensors, self.settings.limits.max_batch)
            REQUESTS.labels(**self._labels, outcome="ok").inc()
            return out
        except BadRequest as exc:
            header.error, header.status = f"stage {self.first}: {exc}", exc.status
        except Exception as exc:  # a failing request must not take the replica down
            log.exception("%s failed on %s", self.replica_id, header.request_id)
            header.error, header.status = f"stage {self.first} failed: {exc}", 500
        finally:
            INFLIGHT.labels(**self._labels).dec()
        REQUESTS.labels(**self._labels, outcome="error").inc()
        return {}

    def _hand_off(self, pipe: redis.client.Pipeline, header: Header, out: dict[str, torch.Tensor]) -> None:
        if header.error is not None or self.next_stream is None:
            pipe.lpush(header.reply_to, pack(header, out))
            pipe.pexpire(header.reply_to, int(self.settings.data.request_timeout_s * 2000))
            return
        header.stage, header.enqueued_at = self.last, time.time()
        pipe.xadd(self.next_stream, {MESSAGE_FIELD: pack(header, out)})

    def _finish(self, msg_id: bytes, pipe: redis.client.Pipeline) -> None:
        # Acknowledge in the same transaction as the hand-off: both happen or neither does.
        pipe.xack(self.stream, keys.GROUP, msg_id)
        pipe.xdel(self.stream, msg_id)
        pipe.execute()
        self._inflight = None

    # -- CPUs ----------------------------------------------------------------------------------

    def _apply_cpus(self, cpus: int) -> None:
        """Changes this replica's CPUs while it runs: the affinity of every thread of the process
        and torch's thread count (emulated stages scale their service time instead)."""
        cores = self._allowed_cpus[: max(1, min(cpus, len(self._allowed_cpus)))]
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), cores)
            except (ProcessLookupError, PermissionError):
                pass
        torch.set_num_threads(len(cores))
        if hasattr(self.runner, "cpus"):
            self.runner.cpus = cpus
        self.cpus = cpus
        self.redis.hset(keys.replica(self.replica_id), "cpus", str(cpus))
        log.info("%s now uses %d CPUs (cores %s)", self.replica_id, cpus, cores)

    # -- liveness ------------------------------------------------------------------------------

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.settings.data.heartbeat_s):
            try:
                heartbeat(self.redis, self.info, self.settings.data.replica_ttl_s)
                wanted = self.redis.get(keys.stage_cpus(self.stage))
                if wanted is not None and wanted.isdigit() and int(wanted) > 0:
                    self._wanted_cpus = int(wanted)
                msg_id = self._inflight
                if msg_id is not None:
                    # Resets the item's idle time, so that long work is not reclaimed from a
                    # replica that is alive.
                    self.redis.xclaim(self.stream, keys.GROUP, self.replica_id, 0, [msg_id], justid=True)
            except redis.ConnectionError as exc:
                log.warning("heartbeat failed: %s", exc)

    # -- direct invoke -------------------------------------------------------------------------

    def invoke(self, body: bytes) -> bytes:
        """Runs this replica's stages on safetensors bytes and answers safetensors bytes."""
        tensors = decode_tensors(body)
        with self._compute_lock:
            out = self.runner.checked_run(tensors, self.settings.limits.max_batch)
        return encode_tensors(out)
