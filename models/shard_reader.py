"""Reads a stage's shard into memory in a background thread, from the first place that has it:
this server's disk, the server's prefetcher (shared memory, possibly still being filled), or the
model store (QUART_MODELS_URL, kept on disk as it arrives). Bytes are hashed as they come and the
whole is checked against the manifest's sha256 at the end.

It imports no torch, so that a cold replica starts reading before it imports its libraries and the
two overlap (HydraServe §5); `models/shard_stream.py` makes tensors of the bytes as they arrive."""
from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from contracts.config import Settings
from contracts.stage import StageRef
from models.fetch import FetchError, ensure_manifest, open_url, partial_path, shard_url
from models.manifest import Manifest, StageInfo
from state.store import RedisStore, Unavailable

log = logging.getLogger("quart.shard_reader")
CHUNK = 4 << 20
POLL_S = 0.01
PART, ERROR = ".part", ".error"


class ShardReader:
    """One shard's bytes in `buffer`, filled by a thread; `wait_for(n)` blocks until the first n
    bytes are there and raises FetchError once the read failed (a checksum, a stall, a cancel)."""

    def __init__(self, info: StageInfo, where: str, chunks: Callable[[memoryview], Iterator[int]],
                 settle: Callable[[bool], None] = lambda ok: None, verify: bool = True) -> None:
        """`chunks` fills the buffer it is given and yields each chunk's length; `settle(ok)` is
        told whether the whole read was good (a copy being kept on disk is then kept or removed);
        `verify`: hash the bytes here (False where the source checked them already)."""
        self.info, self.where, self.verify = info, where, verify
        self._settle = settle
        self.buffer = bytearray(info.bytes)
        self.filled = 0
        self.error: FetchError | None = None
        self.done = False
        self.started = self.finished = 0.0
        self._chunks = chunks
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"shard-{info.index}", daemon=True)

    def start(self) -> ShardReader:
        self.started = time.time()
        self._thread.start()
        return self

    def _run(self) -> None:
        digest = hashlib.sha256()
        view = memoryview(self.buffer)
        try:
            for n in self._chunks(view):
                if self.verify:
                    digest.update(view[self.filled:self.filled + n])
                with self._changed:
                    self.filled += n
                    self._changed.notify_all()
            if self.filled != self.info.bytes:
                raise FetchError(f"{self.where}: {self.filled} bytes, the manifest says {self.info.bytes}")
            if self.verify and digest.hexdigest() != self.info.sha256:
                raise FetchError(f"shard {self.info.shard} from {self.where}: sha256 {digest.hexdigest()[:12]}… "
                                 f"is not the manifest's {self.info.sha256[:12]}…")
        except FetchError as exc:
            self._finish(exc)
        except Exception as exc:  # any failure of the source ends the read with its reason
            self._finish(FetchError(f"reading shard {self.info.shard} from {self.where}: {exc}"))
        else:
            self._finish(None)

    def _finish(self, error: FetchError | None) -> None:
        try:
            self._settle(error is None)
        except OSError as exc:
            log.warning("shard %s: keeping the copy failed: %s", self.info.shard, exc)
        with self._changed:
            self.error, self.done, self.finished = error, True, time.time()
            self._changed.notify_all()

    def wait_for(self, end: int) -> None:
        """Until bytes [0, end) are in the buffer."""
        with self._changed:
            self._changed.wait_for(lambda: self.filled >= end or self.done)
        if self.error is not None:
            raise self.error
        if self.filled < end:
            raise FetchError(f"shard {self.info.shard} ended at {self.filled} bytes; {end} were needed")

    def wait_done(self) -> None:
        """Until the whole shard is read and its sha256 checked."""
        with self._changed:
            self._changed.wait_for(lambda: self.done)
        if self.error is not None:
            raise self.error


@contextmanager
def start_failures_recorded(settings: Settings, stage: StageRef) -> Iterator[None]:
    """A cold start that fails for its shard (a checksum, a shard nowhere) leaves its reason in
    Redis for the requests waiting on the stage (their entry answers 503 with it), then fails."""
    try:
        yield
    except (FetchError, FileNotFoundError) as exc:
        try:
            RedisStore.from_url(settings.redis_url, timeout_s=5).record_start_failure(
                stage, str(exc), settings.data.request_timeout_s)
        except Unavailable as down:
            log.warning("could not record why %s failed to start: %s", stage, down)
        raise


def start_readers(settings: Settings, stage: StageRef) -> dict[int, ShardReader]:
    """A started reader per stage of `stage`, each from the first place that holds its shard."""
    manifest = ensure_manifest(settings, stage.model, tokenizer=False)
    return {i: _reader(settings, stage.model, manifest, manifest.stages[i]).start() for i in stage.indices()}


def _reader(settings: Settings, model: str, manifest: Manifest, info: StageInfo) -> ShardReader:
    local = manifest.directory / info.shard
    if local.is_file():
        return ShardReader(info, str(local), lambda view: _read_file(local, view))
    prefetched = settings.prefetch_dir(settings.server) / model / info.shard
    if prefetched.with_name(prefetched.name + PART).exists() or prefetched.exists():  # .part first, as in _follow
        # The prefetcher checks the sha256 and renames the .part only then: its rename is the check.
        return ShardReader(info, f"prefetch {prefetched}", lambda view: _follow(prefetched, view, settings.coldstart.stall_s),
                           verify=False)
    if settings.models_url:
        url = shard_url(settings, model, info.shard)
        partial = partial_path(local)
        return ShardReader(info, url, lambda view: _download(url, settings.internal_api_token(), partial, view),
                           lambda ok: partial.rename(local) if ok else partial.unlink(missing_ok=True))
    raise FetchError(f"no shard {info.shard} of {model} in {manifest.directory}, none prefetched, "
                     f"and no QUART_MODELS_URL to fetch it from")


def _read_file(path: Path, view: memoryview) -> Iterator[int]:
    with open(path, "rb", buffering=0) as f:
        filled = 0
        while filled < len(view) and (n := f.readinto(view[filled:filled + CHUNK])):
            filled += n
            yield n


def _follow(path: Path, view: memoryview, stall_s: float) -> Iterator[int]:
    """A shard the prefetcher is still writing (`<shard>.part`, renamed `<shard>` once whole and
    checked): read what is there, wait for more, and end once it is renamed; its `.error` file
    or a stall of the model's whole arrival (`Arrival`) ends the read."""
    part, error = path.with_name(path.name + PART), path.with_name(path.name + ERROR)
    f = _open_either(path, part)
    filled, arrival = 0, Arrival(path.parent, stall_s)
    with f:
        while filled < len(view) or not path.exists():
            n = f.readinto(view[filled:filled + CHUNK]) if filled < len(view) else 0
            if n:
                filled += n
                arrival.moved()
                yield n
                continue
            if error.exists():
                raise FetchError(f"the prefetch of {path.name} failed: {error.read_text().strip()}")
            # The .part first: once it is gone, a rename to the whole shard has already happened
            # (looking at the shard first could miss it on both sides of a rename in between).
            if not (part.exists() or path.exists()):
                time.sleep(10 * POLL_S)  # a failed prefetch removes its .part just before writing its .error
                if error.exists():
                    raise FetchError(f"the prefetch of {path.name} failed: {error.read_text().strip()}")
                raise FetchError(f"the prefetch of {path.name} was cancelled")
            if arrival.stalled():
                raise FetchError(f"the prefetch of {path.name} made no progress for {stall_s:g} s")
            time.sleep(POLL_S)


class Arrival:
    """A model's arrival in its prefetch folder, as a reader waiting for one shard judges it:
    stalled once no byte of any of its files has arrived for `stall_s` (a multicast sends a
    server its shards in the plan's order, so one shard may wait at zero bytes while the shards
    before it arrive). The folder is looked at only once the reader itself has waited that long."""

    def __init__(self, folder: Path, stall_s: float) -> None:
        self.folder, self.stall_s = folder, stall_s
        self._bytes, self._since = arrival_bytes(folder), time.monotonic()

    def moved(self) -> None:
        """The reader got bytes of its own: progress."""
        self._since = time.monotonic()

    def stalled(self) -> bool:
        if time.monotonic() - self._since <= self.stall_s:
            return False
        if (now := arrival_bytes(self.folder)) == self._bytes:
            return True
        self._bytes, self._since = now, time.monotonic()
        return False


def arrival_bytes(folder: Path) -> int:
    """The bytes of every file in a model's prefetch folder: shards whole and arriving."""
    total = 0
    for entry in os.scandir(folder):
        try:
            total += entry.stat().st_size
        except FileNotFoundError:  # a .part renamed as we looked
            pass
    return total


def record_prefetch_error(target: Path, message: str) -> None:
    """`<shard>.error`, written whole (a temporary file renamed): a reader that sees it reads the
    whole message, never an empty file the writer has just created."""
    error = target.with_name(target.name + ERROR)
    tmp = error.with_name(error.name + ".tmp")
    tmp.write_text(message)
    tmp.replace(error)


def _open_either(path: Path, part: Path):
    for _ in range(3):  # the .part may be renamed between the two looks
        for candidate in (path, part):
            try:
                return open(candidate, "rb", buffering=0)
            except FileNotFoundError:
                pass
    raise FetchError(f"the prefetch of {path.name} is gone")


def _download(url: str, token: str, partial: Path, view: memoryview) -> Iterator[int]:
    """The shard from the model store into the buffer and into `partial` on disk (renamed to the
    shard once its sha256 is checked)."""
    partial.parent.mkdir(parents=True, exist_ok=True)
    filled = 0
    with open_url(url, token) as reply, open(partial, "wb") as out:
        while filled < len(view) and (n := reply.readinto(view[filled:filled + CHUNK])):
            out.write(view[filled:filled + n])
            filled += n
            yield n
