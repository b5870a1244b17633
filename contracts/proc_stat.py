"""The one reader of /proc/<pid>/stat: a process's state and start time, which tell it from a
later process given the same pid (the runtime's watched processes) and time a cold start from
its process's start (a replica's own record)."""
from __future__ import annotations

import os
import time


def stat_fields(pid: int | str) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state, ppid, pgrp, ...); None when
    there is no such process. The name may hold spaces and parentheses: split after the last one."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def start_time(pid: int | str) -> int | None:
    """When the process started (clock ticks since boot, /proc/<pid>/stat field 22); None when
    there is no such process or it has exited (a zombie only waits to be reaped)."""
    fields = stat_fields(pid)
    return None if fields is None or fields[0] == "Z" else int(fields[19])


def started_at(pid: int | str = "self") -> float:
    """When a running process started, as time.time()."""
    ticks = start_time(pid)
    if ticks is None:
        raise ProcessLookupError(f"no running process {pid}")
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))
