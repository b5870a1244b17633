"""The server's model prefetcher (HydraServe §5.1): once a cold start is placed here, it pulls the
replica's shards from the model store (QUART_MODELS_URL) into shared memory while the replica's
process is still being created. The replica reads a shard as it is written (`<shard>.part`,
renamed `<shard>` once whole and checked; `<shard>.error` says why one failed:
`models/shard_reader.py`). A finished prefetch is freed after QUART_PREFETCH_TTL_S, a cancelled
one at once."""
from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from contracts.config import Settings
from contracts.stage import StageRef
from keysmanager.pacing import Link
from models.fetch import FetchError, download, ensure_manifest, shard_url
from models.manifest import StageInfo
from models.shard_reader import ERROR, PART, record_prefetch_error

log = logging.getLogger("quart.prefetch")


class NoStore(RuntimeError):
    """There is no model store to prefetch from (QUART_MODELS_URL is unset here)."""


@dataclass
class Prefetch:
    stage: StageRef
    shards: list[str]
    bytes: int
    started: float = field(default_factory=time.time)
    finished: float | None = None
    error: str = ""
    cancelled: threading.Event = field(default_factory=threading.Event)

    def view(self) -> dict:
        state = "failed" if self.error else "done" if self.finished else "fetching"
        return {"model": self.stage.model, "stages": self.stage.stages, "shards": self.shards, "bytes": self.bytes,
                "state": state, "error": self.error, "started": self.started, "finished": self.finished}


class Prefetcher:
    def __init__(self, settings: Settings, downlink: Link,
                 received: Callable[[str, str], bool] = lambda model, shard: False) -> None:
        """`downlink`: what this server's prefetches read through (keysmanager/pacing.py);
        `received(model, shard)`: whether this server receives that shard from its peers (a
        multicast writes it where a prefetch would: it is not prefetched as well)."""
        self.settings = settings
        self.downlink = downlink
        self.received = received
        self.root = settings.prefetch_dir(settings.server)
        self._jobs: dict[str, Prefetch] = {}
        # shard path -> set once its download ends: a shard of two overlapping ranges is fetched once
        self._fetching: dict[Path, threading.Event] = {}
        self._lock = threading.Lock()

    def start(self, stage: StageRef) -> dict:
        """Starts pulling `stage`'s shards (a no-op for one being pulled or pulled already)."""
        if not self.settings.models_url:
            raise NoStore("no QUART_MODELS_URL: this server reads its models from its own disk")
        with self._lock:
            job = self._jobs.get(stage.key)
            if job is not None and not job.error:
                return job.view()
        manifest = ensure_manifest(self.settings, stage.model, tokenizer=False)  # raises FetchError for an unknown model
        infos = [manifest.stages[i] for i in stage.indices() if i < manifest.num_stages]
        if len(infos) != stage.last - stage.first:
            raise ValueError(f"{stage.model} has {manifest.num_stages} stages; {stage.stages} is not among them")
        job = Prefetch(stage, [i.shard for i in infos], sum(i.bytes for i in infos))
        with self._lock:
            self._jobs[stage.key] = job
        threading.Thread(target=self._run, args=(job, infos), name=f"prefetch-{stage.key}", daemon=True).start()
        return job.view()

    def _run(self, job: Prefetch, infos: list) -> None:
        token = self.settings.internal_api_token()
        folder = self.root / job.stage.model
        for info in infos:
            target = folder / info.shard
            try:
                self._fetch_once(job, info, target, token)
            except (FetchError, OSError) as exc:
                job.error = str(exc)
                if not job.cancelled.is_set():
                    record_prefetch_error(target, job.error)
                log.warning("prefetch of %s failed: %s", job.stage, exc)
                return
        job.finished = time.time()
        log.info("prefetched %s (%d bytes) in %.2f s", job.stage, job.bytes, job.finished - job.started)

    def _fetch_once(self, job: Prefetch, info: StageInfo, target: Path, token: str) -> None:
        """`target` downloaded unless it is here, received from peers, or being downloaded by
        another prefetch (one whose range overlaps): then that download is waited for, and made
        again here only where it failed."""
        while not (target.is_file() or self.received(job.stage.model, info.shard)):
            with self._lock:
                other = self._fetching.get(target)
                if other is None:
                    mine = self._fetching[target] = threading.Event()
            if other is not None:
                while not other.wait(0.1):
                    if job.cancelled.is_set():
                        raise FetchError(f"{info.shard}: cancelled")
                continue
            try:
                target.with_name(target.name + ERROR).unlink(missing_ok=True)
                # `<shard>.part`, the name the replicas following it look for
                download(shard_url(self.settings, job.stage.model, info.shard), token, target, info.sha256,
                         job.cancelled.is_set, target.with_name(target.name + PART), self.downlink.take)
                return
            finally:
                with self._lock:
                    del self._fetching[target]
                mine.set()

    def list(self) -> list[dict]:
        with self._lock:
            return [job.view() for job in self._jobs.values()]

    def cancel(self, model: str) -> list[dict]:
        """Stops every prefetch of `model` and frees what they had written."""
        with self._lock:
            jobs = [self._jobs.pop(key) for key in [k for k, j in self._jobs.items() if j.stage.model == model]]
        for job in jobs:
            job.cancelled.set()
        shutil.rmtree(self.root / model, ignore_errors=True)
        return [job.view() for job in jobs]

    def sweep(self, now: float | None = None) -> None:
        """Frees the prefetches finished (or failed) more than QUART_PREFETCH_TTL_S ago."""
        now = time.time() if now is None else now
        ttl = self.settings.coldstart.prefetch_ttl_s
        with self._lock:
            old = [k for k, j in self._jobs.items() if (j.finished or j.error) and now - (j.finished or j.started) > ttl]
            jobs = [self._jobs.pop(k) for k in old]
        for job in jobs:
            for shard in job.shards:
                for suffix in ("", PART, ERROR):
                    Path(self.root / job.stage.model / (shard + suffix)).unlink(missing_ok=True)

    def shutdown(self) -> None:
        for job in list(self._jobs.values()):
            job.cancelled.set()
        shutil.rmtree(self.root, ignore_errors=True)
