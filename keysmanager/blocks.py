"""λScale's multicast on one server (§4.2): the KeysManager serves the pieces of the shards it
holds to its peers (`pieces`), and receives a shard from them by a schedule of pulls that the
planner made (scheduler/multicast.py; runtime/multicast.py turns a plan into schedules).

A shard arriving here (`Reception`) is checked piece by piece against the manifest's hashes
(models/manifest.PIECE_BYTES each) and written to the prefetch folder as `<shard>.part` in order,
the pieces that came early held in memory until the ones before them have: a replica starting
here follows the file as it does a prefetch (models/shard_reader.py), and it is renamed `<shard>`
once every piece is in. While it arrives, the pieces it holds are served on to the peers whose
schedules name this server (a pull of pieces not here yet is answered 409, and retried). A block
that fails its hash is fetched again; a peer that does not answer is replaced by the holders
(`fallbacks`), so one receiver's death does not stop the others."""
from __future__ import annotations

import hashlib
import http.client
import logging
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from contracts.config import Settings
from contracts.secrets import bearer
from models.fetch import FetchError, ensure_manifest
from models.manifest import PIECE_BYTES, Manifest, StageInfo
from models.shard_reader import ERROR, PART, record_prefetch_error

log = logging.getLogger("quart.multicast")

# A pull asks for at most this many pieces (a block of a 512 MB stage at b = 2 fits).
MAX_PULL_PIECES = 256
# Tries of one block from one peer whose answer failed its hash, before the next source.
CORRUPT_TRIES = 2
# How often a pull of pieces the peer does not hold yet is asked again; the peer holds such a
# pull this long, answering as soon as they arrive, before it answers 409 (a pull a round,
# not a request every poll, even when a block arrives late).
NOT_YET_POLL_S = 0.01
HOLD_S = 2.0


class NotYet(Exception):
    """Pieces this server is receiving and does not hold yet."""


class Gone(Exception):
    """A shard this server was receiving and failed to: its peers take it from elsewhere."""


class Corrupt(ValueError):
    """A block whose pieces do not match the manifest's hashes."""


@dataclass(frozen=True)
class Pull:
    source: str   # the base URL of the KeysManager to pull from
    first: int    # pieces [first, end)
    end: int


@dataclass
class Reception:
    """One shard arriving on this server."""
    model: str
    info: StageInfo
    target: Path
    pulls: list[Pull]
    fallbacks: list[str]
    started: float = field(default_factory=time.time)
    finished: float | None = None
    error: str = ""
    refetched: int = 0        # blocks fetched again after failing their hash
    rerouted: int = 0         # blocks taken from a holder because the planned peer did not answer
    filled: int = 0           # pieces written to <shard>.part, in order
    held: dict[int, bytes] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    cancelled: threading.Event = field(default_factory=threading.Event)

    @property
    def part(self) -> Path:
        return self.target.with_name(self.target.name + PART)

    def add(self, first: int, pieces: list[bytes]) -> None:
        """Checked pieces from `first` on (`checked_pieces`), written in order as far as they reach
        (nothing once cancelled: its files are being freed)."""
        with self.lock:
            if self.cancelled.is_set():
                return
            for offset, piece in enumerate(pieces):
                if first + offset >= self.filled:
                    self.held[first + offset] = piece
            with open(self.part, "ab") as f:
                while self.filled in self.held:
                    f.write(self.held.pop(self.filled))
                    self.filled += 1
            if self.filled == len(self.info.pieces):
                self.part.rename(self.target)  # the reader's sign that the shard is whole and checked
                self.finished = time.time()

    def has(self, first: int, end: int) -> bool:
        with self.lock:
            return all(i < self.filled or i in self.held for i in range(first, end))

    def read(self, first: int, end: int) -> bytes:
        """Pieces [first, end) as far as they are here; NotYet for any that is not."""
        with self.lock:
            if any(i >= self.filled and i not in self.held for i in range(first, end)):
                raise NotYet(f"pieces {first}-{end} of {self.info.shard} are still arriving")
            written = min(end, self.filled)
            data = _read_range(self.target if self.finished else self.part, first, written) if first < written else b""
            return data + b"".join(self.held[i] for i in range(max(first, written), end))

    def view(self) -> dict:
        state = "failed" if self.error else "done" if self.finished else "receiving"
        return {"model": self.model, "shard": self.info.shard, "state": state, "error": self.error,
                "pieces": len(self.info.pieces), "filled": self.filled, "refetched": self.refetched,
                "rerouted": self.rerouted, "started": self.started, "finished": self.finished}


def _read_range(path: Path, first: int, end: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(first * PIECE_BYTES)
        return f.read((end - first) * PIECE_BYTES)


class Receiver:
    """The shards this server receives from its peers, and the pieces it serves them."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.root = settings.prefetch_dir(settings.server)
        self._token = settings.internal_api_token()
        self._jobs: dict[tuple[str, str], Reception] = {}
        self._lock = threading.Lock()

    def manifest(self, model: str) -> Manifest:
        """The model's manifest: on this server's disk, or from the model store."""
        return ensure_manifest(self.settings, model, tokenizer=False)

    def start(self, model: str, info: StageInfo, pulls: list[Pull], fallbacks: list[str]) -> dict:
        """Starts receiving `info`'s shard by `pulls` (a no-op for one being received or held)."""
        key = (model, info.shard)
        target = self.root / model / info.shard
        with self._lock:
            job = self._jobs.get(key)
            if job is not None and not job.error:
                return job.view()
            job = Reception(model, info, target, pulls, fallbacks)
            if target.is_file():
                job.filled, job.finished = len(info.pieces), time.time()
            self._jobs[key] = job
        if job.finished is None:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.with_name(target.name + ERROR).unlink(missing_ok=True)
            job.part.write_bytes(b"")  # there from the start: a replica starting here follows it, not the store
            threading.Thread(target=self._run, args=(job,), name=f"multicast-{model}-{info.shard}", daemon=True).start()
        return job.view()

    def _run(self, job: Reception) -> None:
        try:
            for pull in job.pulls:
                job.add(pull.first, self._fetch(job, pull))
                if job.cancelled.is_set():
                    raise FetchError("cancelled")
        except Exception as exc:  # noqa: BLE001 - whatever stops it, the reception fails with its reason
            job.error = str(exc) or type(exc).__name__
            if job.cancelled.is_set():
                return  # cancel() frees its files
            job.part.unlink(missing_ok=True)
            record_prefetch_error(job.target, job.error)
            log.warning("receiving %s/%s failed: %s", job.model, job.info.shard, exc)
            return
        log.info("received %s/%s (%d pieces) in %.2f s; %d block(s) fetched again, %d from a holder",
                 job.model, job.info.shard, len(job.info.pieces), time.time() - job.started, job.refetched, job.rerouted)

    def _fetch(self, job: Reception, pull: Pull) -> list[bytes]:
        """The block from the peer the plan names: again if it fails its hash, from the holders
        if that peer does not answer (or keeps failing), waiting while a peer has yet to receive it."""
        sources = [pull.source] + [f for f in job.fallbacks if f != pull.source]
        for index, source in enumerate(sources):
            for _ in range(CORRUPT_TRIES):
                data = self._get(job, source, pull)
                if data is None:
                    break  # that peer is gone: the next source
                try:
                    pieces = checked_pieces(job.info, pull, data)
                except Corrupt as exc:
                    job.refetched += 1
                    log.warning("%s from %s: %s; fetching it again", job.info.shard, source, exc)
                    continue
                job.rerouted += index > 0
                return pieces
        raise FetchError(f"no source answered pieces {pull.first}-{pull.end} of {job.model}/{job.info.shard} "
                         f"with their hashes (tried {', '.join(sources)})")

    def _get(self, job: Reception, source: str, pull: Pull) -> bytes | None:
        """The pieces' bytes from one peer, waiting for up to the stall time while it answers 409
        (they are on their way there) or 404 (its own schedule is on its way); None when it does
        not answer, or cannot serve them (410: its reception failed)."""
        url = f"{source.rstrip('/')}/blocks/{job.model}/{job.info.shard}/{pull.first}-{pull.end}"
        deadline = time.monotonic() + self.settings.coldstart.stall_s
        while not job.cancelled.is_set():
            try:
                with urllib.request.urlopen(urllib.request.Request(url, headers=bearer(self._token)), timeout=30) as reply:
                    return reply.read()
            except urllib.error.HTTPError as exc:
                if exc.code not in (404, 409) or time.monotonic() > deadline:
                    log.warning("%s: %s", url, exc)
                    return None
            except (OSError, http.client.HTTPException) as exc:  # refused, reset, cut off mid-block
                log.warning("%s: %s", url, exc)
                return None
            time.sleep(NOT_YET_POLL_S)
        return None

    def pieces(self, model: str, info: StageInfo, local: Path | None, first: int, end: int) -> bytes:
        """Pieces [first, end) of a shard this server holds (`local`, its model directory's file),
        has received, or is receiving (NotYet for pieces still on their way); FileNotFoundError
        where it has none of it."""
        if local is not None and local.is_file():
            return _read_range(local, first, end)
        job = self.receiving(model, info.shard)
        if job is not None and job.error:
            raise Gone(f"{model}/{info.shard} failed to arrive here: {job.error}")
        if job is not None:
            return job.read(first, end)
        received = self.root / model / info.shard
        if received.is_file():
            return _read_range(received, first, end)
        raise FileNotFoundError(f"{model}/{info.shard} is neither held nor being received here")

    def arriving(self, model: str, shard: str, first: int, end: int) -> bool:
        """Whether some of those pieces are still on their way here (a live reception lacks them)."""
        job = self.receiving(model, shard)
        return job is not None and not job.error and not job.cancelled.is_set() and not job.has(first, end)

    def receiving(self, model: str, shard: str) -> Reception | None:
        """The reception of that shard here (under way, done or failed), if any."""
        with self._lock:
            return self._jobs.get((model, shard))

    def list(self) -> list[dict]:
        with self._lock:
            return [job.view() for job in self._jobs.values()]

    def cancel(self, model: str) -> list[dict]:
        """Stops receiving `model`'s shards and frees what they had written here, and the whole
        shards of it an earlier run of this KeysManager left (a prefetch still being written is
        the prefetcher's to cancel)."""
        with self._lock:
            jobs = [self._jobs.pop(key) for key in [k for k in self._jobs if k[0] == model]]
        for job in jobs:
            job.cancelled.set()
            with job.lock:
                job.part.unlink(missing_ok=True)
        folder = self.root / model
        for path in folder.glob("*") if folder.is_dir() else ():
            if not path.name.endswith(PART):
                path.unlink(missing_ok=True)
        return [job.view() for job in jobs]

    def shutdown(self) -> None:
        with self._lock:
            for job in self._jobs.values():
                job.cancelled.set()


def checked_pieces(info: StageInfo, pull: Pull, data: bytes) -> list[bytes]:
    """`data` cut into the pull's pieces, each matching the manifest's hash; Corrupt otherwise."""
    expected = min(info.bytes, pull.end * PIECE_BYTES) - pull.first * PIECE_BYTES
    if len(data) != expected:
        raise Corrupt(f"{len(data)} bytes for pieces {pull.first}-{pull.end} of {info.shard}, not {expected}")
    pieces = [data[i:i + PIECE_BYTES] for i in range(0, len(data), PIECE_BYTES)]
    for index, piece in enumerate(pieces, pull.first):
        if hashlib.sha256(piece).hexdigest() != info.pieces[index]:
            raise Corrupt(f"piece {index} of {info.shard} does not match its hash")
    return pieces
