"""λScale's multicast on one server (§4.2): the KeysManager serves the pieces of the shards it
holds to its peers (`pieces`), and receives a shard from them by a schedule of pulls that the
planner made (scheduler/multicast.py; runtime/multicast.py turns a plan into schedules).

A shard arriving here (`Reception`) is checked piece by piece against the manifest's hashes
(models/manifest.PIECE_BYTES each) as it streams in, and written by a thread of its own to the
prefetch folder as `<shard>.part` in order, the pieces that came early held in memory until the
ones before them have: a replica starting here follows the file as it does a prefetch
(models/shard_reader.py), and it is renamed `<shard>` once every piece is in. While it arrives,
the pieces it holds are served on to the peers whose schedules name this server (a pull of pieces
on their way is held until they land, for up to HOLD_S, then answered 409 and asked again), each
in its turn in the plan (keysmanager/pacing.SendOrder). A block that fails its hash is fetched
again; a peer that does not answer is replaced by the holders (`fallbacks`), so one receiver's
death does not stop the others."""
from __future__ import annotations

import hashlib
import http.client
import logging
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from contracts.config import Settings
from contracts.secrets import bearer
from keysmanager.pacing import Link
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
URL_RE = re.compile(r"https?://[^\s/]+(/\S*)?")
PLAN_RE = re.compile(r"([0-9a-f]{1,32})?")
INT_RE = re.compile(r"-?\d{1,9}")


class NotYet(Exception):
    """Pieces this server is receiving and does not hold yet."""


class Gone(Exception):
    """A shard this server was receiving and failed to: its peers take it from elsewhere."""


class Corrupt(ValueError):
    """A block whose pieces do not match the manifest's hashes."""


@dataclass(frozen=True)
class Turn:
    """A pull's place in its multicast plan: the plan, the pull's round in it, and the round of
    the source's send before it, which the source sends first (keysmanager/pacing.SendOrder)."""
    plan: str
    round: int
    after: int = -1

    def fields(self) -> dict[str, str | int]:
        return {"plan": self.plan, "round": self.round, "after": self.after}

    @classmethod
    def parse(cls, fields: Mapping[str, object]) -> Turn | None:
        """From a pull's JSON or the block route's query (where the numbers are strings); None
        where it names no plan; ValueError naming what is wrong."""
        plan = fields.get("plan", "")
        if not isinstance(plan, str) or not PLAN_RE.fullmatch(plan):
            raise ValueError("'plan' must be up to 32 hex digits")
        if not plan:
            return None
        numbers = [fields.get("round"), fields.get("after", -1)]
        numbers = [int(x) if isinstance(x, str) and INT_RE.fullmatch(x) else x for x in numbers]
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in numbers):
            raise ValueError("'round' and 'after' must be integers")
        turn = cls(plan, *numbers)
        if not -1 <= turn.after < turn.round:
            raise ValueError("'after' must be -1 or a round before 'round'")
        return turn


@dataclass(frozen=True)
class Pull:
    """One block of a receiver's schedule, as POST /multicast carries it (`to_json`, `from_json`)."""
    source: str   # the base URL of the KeysManager to pull from
    first: int    # pieces [first, end)
    end: int
    turn: Turn | None = None  # none: sent as soon as its pieces are there

    def to_json(self) -> dict:
        return {"source": self.source, "first": self.first, "end": self.end, **(self.turn.fields() if self.turn else {})}

    @classmethod
    def from_json(cls, obj: object) -> Pull:
        """A pull from its JSON; ValueError naming what is wrong."""
        if not isinstance(obj, dict):
            raise ValueError("each pull is an object {source, first, end[, plan, round, after]}")
        source, first, end = obj.get("source"), obj.get("first"), obj.get("end")
        if not isinstance(source, str) or not URL_RE.fullmatch(source):
            raise ValueError("a pull's 'source' must be a KeysManager's http(s) URL")
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (first, end)):
            raise ValueError("a pull's 'first' and 'end' must be piece indices")
        return cls(source, first, end, Turn.parse(obj))


@dataclass
class Reception:
    """One shard arriving on this server: the pulls put checked pieces in (`add`), a writer thread
    of its own writes them out in order (`write`), so that neither the next pull nor a peer's read
    waits for the disk."""
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
    held: dict[int, bytes] = field(default_factory=dict)   # pieces here and not written yet
    lock: threading.Lock = field(default_factory=threading.Lock)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.changed = threading.Condition(self.lock)  # a piece came, one was written, or it stopped

    @property
    def part(self) -> Path:
        return self.target.with_name(self.target.name + PART)

    @property
    def ended(self) -> bool:
        return bool(self.finished or self.error or self.cancelled.is_set())

    def add(self, first: int, pieces: list[bytes]) -> None:
        """Checked pieces from `first` on, for the writer (nothing once it has ended)."""
        with self.lock:
            if self.ended:
                return
            for offset, piece in enumerate(pieces):
                if first + offset >= self.filled:
                    self.held[first + offset] = piece
            self.changed.notify_all()

    def stop(self, error: str) -> None:
        """Ends it as failed with `error` (the first reason given stays)."""
        with self.lock:
            self.error = self.error or error
            self.changed.notify_all()

    def cancel(self) -> None:
        with self.lock:
            self.cancelled.set()
            self.changed.notify_all()

    def write(self) -> None:
        """The writer: the pieces to `<shard>.part` in order as far as they reach, as they come,
        and the file renamed `<shard>` once every one is in (the reader's sign that the shard is
        whole and checked)."""
        try:
            with open(self.part, "ab") as f:
                while True:
                    with self.lock:
                        while self.filled not in self.held and not self.ended:
                            self.changed.wait()
                        if self.ended:
                            return
                        run = []
                        while self.filled + len(run) in self.held:
                            run.append(self.held[self.filled + len(run)])
                    for piece in run:
                        f.write(piece)
                    f.flush()
                    with self.lock:
                        for index in range(self.filled, self.filled + len(run)):
                            del self.held[index]
                        self.filled += len(run)
                        if self.filled == len(self.info.pieces) and not self.ended:
                            self.part.rename(self.target)
                            self.finished = time.time()
                        self.changed.notify_all()
        except OSError as exc:
            self.stop(f"writing {self.part}: {exc}")

    def wait(self) -> None:
        """Returns once it has ended: whole, failed or cancelled."""
        with self.lock:
            while not self.ended:
                self.changed.wait()

    def has(self, first: int, end: int) -> bool:
        with self.lock:
            return all(i < self.filled or i in self.held for i in range(first, end))

    def read(self, first: int, end: int) -> bytes:
        """Pieces [first, end) as far as they are here; NotYet for any that is not. The file is
        read outside the lock (its first `filled` pieces do not change)."""
        with self.lock:
            if any(i >= self.filled and i not in self.held for i in range(first, end)):
                raise NotYet(f"pieces {first}-{end} of {self.info.shard} are still arriving")
            written = min(end, self.filled)
            tail = [self.held[i] for i in range(max(first, written), end)]
            f = open(self.target if self.finished else self.part, "rb") if first < written else None  # noqa: SIM115
        if f is None:
            return b"".join(tail)
        with f:
            return _read_from(f, first, written) + b"".join(tail)

    def view(self) -> dict:
        state = "failed" if self.error else "done" if self.finished else "receiving"
        return {"model": self.model, "shard": self.info.shard, "state": state, "error": self.error,
                "pieces": len(self.info.pieces), "filled": self.filled, "refetched": self.refetched,
                "rerouted": self.rerouted, "started": self.started, "finished": self.finished}


def _read_range(path: Path, first: int, end: int) -> bytes:
    with open(path, "rb") as f:
        return _read_from(f, first, end)


def _read_from(f: BinaryIO, first: int, end: int) -> bytes:
    f.seek(first * PIECE_BYTES)
    return f.read((end - first) * PIECE_BYTES)


class Receiver:
    """The shards this server receives from its peers, and the pieces it serves them."""

    def __init__(self, settings: Settings, downlink: Link) -> None:
        """`downlink`: what this server's receptions read through (keysmanager/pacing.py)."""
        self.settings = settings
        self.downlink = downlink
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
        threading.Thread(target=job.write, name=f"multicast-writer-{job.info.shard}", daemon=True).start()
        try:
            for pull in job.pulls:
                if job.ended:
                    break
                job.add(pull.first, self._fetch(job, pull))
            job.wait()
            if job.error:
                raise FetchError(job.error)
        except Exception as exc:  # noqa: BLE001 - whatever stops it, the reception fails with its reason
            job.stop(str(exc) or type(exc).__name__)
            if job.cancelled.is_set():
                return  # cancel() frees its files
            job.part.unlink(missing_ok=True)
            record_prefetch_error(job.target, job.error)
            log.warning("receiving %s/%s failed: %s", job.model, job.info.shard, exc)
            return
        if job.finished:
            log.info("received %s/%s (%d pieces) in %.2f s; %d block(s) fetched again, %d from a holder", job.model,
                     job.info.shard, len(job.info.pieces), job.finished - job.started, job.refetched, job.rerouted)

    def _fetch(self, job: Reception, pull: Pull) -> list[bytes]:
        """The block from the peer the plan names: again if it fails its hash, from the holders
        if that peer does not answer (or keeps failing), waiting while a peer has yet to receive it."""
        sources = [pull.source] + [f for f in job.fallbacks if f != pull.source]
        for index, source in enumerate(sources):
            for _ in range(CORRUPT_TRIES):
                try:
                    pieces = self._get(job, source, pull)
                except Corrupt as exc:
                    job.refetched += 1
                    log.warning("%s from %s: %s; fetching it again", job.info.shard, source, exc)
                    continue
                if pieces is None:
                    break  # that peer is gone: the next source
                job.rerouted += index > 0
                return pieces
        raise FetchError(f"no source answered pieces {pull.first}-{pull.end} of {job.model}/{job.info.shard} "
                         f"with their hashes (tried {', '.join(sources)})")

    def _get(self, job: Reception, source: str, pull: Pull) -> list[bytes] | None:
        """The pieces from one peer, each checked as it comes in (Corrupt for one that does not
        match), waiting while the peer answers 429 (their turn on its link has not come), and for
        up to the stall time while it answers 409 (they are on their way there) or 404 (its own
        schedule is on its way); None when it does not answer, or cannot serve them (410: its
        reception failed)."""
        url = f"{source.rstrip('/')}/blocks/{job.model}/{job.info.shard}/{pull.first}-{pull.end}"
        if source == pull.source and pull.turn:  # a holder standing in for a peer sends it out of turn
            url += "?" + urllib.parse.urlencode(pull.turn.fields())
        deadline = time.monotonic() + self.settings.coldstart.stall_s
        while not job.cancelled.is_set():
            try:
                with urllib.request.urlopen(urllib.request.Request(url, headers=bearer(self._token)), timeout=30) as reply:
                    return read_checked(job.info, pull, reply, self.downlink.take)
            except urllib.error.HTTPError as exc:
                if exc.code == 429:  # the peer's link is busy with its plan's earlier rounds: it is alive
                    deadline = time.monotonic() + self.settings.coldstart.stall_s
                elif exc.code not in (404, 409) or time.monotonic() > deadline:
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
            job.cancel()
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
                job.cancel()


def read_checked(info: StageInfo, pull: Pull, stream: BinaryIO,
                 pace: Callable[[int], None] = lambda size: None) -> list[bytes]:
    """The pull's pieces read from `stream` one at a time (each once `pace` lets its bytes in),
    each checked against the manifest's hash as it comes (so the hashing overlaps the transfer);
    Corrupt for a piece that does not match or a body of the wrong length."""
    pieces = []
    for index in range(pull.first, pull.end):
        size = min(PIECE_BYTES, info.bytes - index * PIECE_BYTES)
        pace(size)
        piece = stream.read(size)
        if len(piece) != size:
            raise Corrupt(f"{len(piece)} bytes for piece {index} of {info.shard}, not {size}")
        if hashlib.sha256(piece).hexdigest() != info.pieces[index]:
            raise Corrupt(f"piece {index} of {info.shard} does not match its hash")
        pieces.append(piece)
    if stream.read(1):
        raise Corrupt(f"more bytes than pieces {pull.first}-{pull.end} of {info.shard}")
    return pieces
