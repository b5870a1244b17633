"""A stage step's threads from the host's idle cores. With one request in flight only one stage
of a pipeline computes at a time, and a decode step at one token is bound by how fast one thread
reads the weights (on a 2-core Xeon, one SmolLM2 stage: 9.6-12.9 ms a step on one thread, 6.7-7.9
on two); under load every replica computes, and threads beyond a replica's share only contend.

So the replicas of a host share a small file, a slot each, holding when the replica's current
step started (0 while it is not computing). Before a step a replica marks its slot and counts the
other marks: alone, and with no two steps overlapping in the last CALM_S, it takes every core;
else its own share (QUART_THREADS, or what the autoscaler's CPU compensation gave it), and it
notes the overlap. A replica that dies mid-step leaves a mark, which stops counting after STALE_S.

A step keeps the threads it took until it ends, so one that starts while another holds every core
runs beside it oversubscribed (three threads on two cores), and OpenMP's barriers wait on the
thread that is not scheduled. Without the calm window (each step taking the cores the others
left) the generation benchmark's pipeline collapsed so at 4 concurrent requests (2.4 tokens/s,
docs/benchmarks.md); with it that happens at most to the steps that begin a burst.

By default (QUART_IDLE_CORES=all) a step that holds a prefill takes them, so one request's prompt
runs on every core at every stage, and so does a decode step that a compiled graph serves on that
many threads: measured side by side (`python -m benchmarks idle_cores`) one request's token gains,
4 and 16 concurrent show no difference. Eager decode steps keep their own (engine/replica.py says
why). With `prefill` only the prefills take them. Either way the board sees only steps, not other
processes, and a step that takes cores another process uses runs oversubscribed (a background
compile runs at nice 19, below it).

Written here because nothing in the standard library or torch shares such flags between
unrelated processes without a lock per step: each slot has one writer, and an aligned 8-byte
store is read whole."""
from __future__ import annotations

import fcntl
import math
import mmap
import os
import struct
import time
from pathlib import Path

SLOT = struct.Struct("qd")   # pid, when its step started (time.monotonic(); 0: not computing)
SLOTS = 256
STALE_S = 30.0               # longer than any step: a mark older than this is a dead replica's
# After two steps overlapped, none takes more than its own share for this long: under load steps
# overlap all the time, and one that took the idle cores would be oversubscribed by the next.
CALM_S = 1.0
OVERLAP = struct.Struct("d")  # after the slots: when two steps last overlapped
SIZE = SLOT.size * SLOTS + OVERLAP.size


def usable_cores() -> int:
    """The cores this process may run on: its affinity, capped by its cgroup's CPU quota (a
    container limited to 2 CPUs on a 64-core host must not start 64 threads)."""
    cores = len(os.sched_getaffinity(0))
    quota = _cgroup_quota()
    return cores if quota is None else max(1, min(cores, math.ceil(quota)))


def _cgroup_quota() -> float | None:
    """CPUs the cgroup may use (v2's cpu.max, else v1's CFS quota), None where unlimited."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        try:
            quota = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text().strip()
            period = Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    if quota in ("max", "-1"):
        return None
    return int(quota) / int(period)


class CoreBoard:
    def __init__(self, path: Path, cores: int | None = None) -> None:
        """Takes a slot in the board at `path` (created if missing) for this process."""
        self.cores = cores or usable_cores()
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)   # one replica at a time chooses its slot
            if os.fstat(fd).st_size < SIZE:
                os.ftruncate(fd, SIZE)
            self._map = mmap.mmap(fd, SIZE)
            self._slot = self._free_slot()
            self._offset = SLOT.size * self._slot
            SLOT.pack_into(self._map, self._offset, os.getpid(), 0.0)
        finally:
            # Unlocked explicitly: the mapping holds the file open (mmap keeps a duplicate), and
            # with it the lock, until the mapping is closed.
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _free_slot(self) -> int:
        for i, (pid, _) in enumerate(SLOT.iter_unpack(self._map[:SLOT.size * SLOTS])):
            if pid == 0 or not _alive(pid):
                return i
        raise RuntimeError(f"all {SLOTS} slots of the core board are held by live processes")

    def begin(self, own: int) -> int:
        """Marks this replica computing; the threads its step may use (at least `own`)."""
        now = time.monotonic()
        struct.pack_into("d", self._map, self._offset + 8, now)
        slots = memoryview(self._map)[:SLOT.size * SLOTS]
        others = sum(1 for i, (_, since) in enumerate(SLOT.iter_unpack(slots))
                     if i != self._slot and since and now - since < STALE_S)
        slots.release()
        if others:
            OVERLAP.pack_into(self._map, SLOT.size * SLOTS, now)
            return own
        if now - OVERLAP.unpack_from(self._map, SLOT.size * SLOTS)[0] < CALM_S:
            return own
        return max(own, self.cores)

    def end(self) -> None:
        struct.pack_into("d", self._map, self._offset + 8, 0.0)

    def close(self) -> None:
        SLOT.pack_into(self._map, self._offset, 0, 0.0)
        self._map.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # someone else's process: alive
        return True
    return True
