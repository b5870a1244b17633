"""Keeps the runtime's logs bounded. Every process writes its log through a descriptor opened for
appending, which the runtime cannot reopen, so a log over the limit is copied to `<name>.1` (older
copies shifted to `.2`, ... up to `keep`) and then truncated in place: the writers go on at the new
end of the file (logrotate's copytruncate; lines written between the copy and the truncation are
lost, a few at most)."""
from __future__ import annotations

import shutil
from pathlib import Path


def rotate(logs: Path, max_bytes: int, keep: int) -> list[Path]:
    """Rotates every `*.log` in `logs` larger than `max_bytes`; returns those rotated."""
    rotated = []
    for log in sorted(logs.glob("*.log")):
        try:
            if log.stat().st_size <= max_bytes:
                continue
        except FileNotFoundError:
            continue
        for i in range(keep - 1, 0, -1):
            older = log.with_name(f"{log.name}.{i}")
            if older.exists():
                older.replace(log.with_name(f"{log.name}.{i + 1}"))
        if keep > 0:
            shutil.copyfile(log, log.with_name(f"{log.name}.1"))
        with open(log, "r+b") as f:
            f.truncate(0)
        rotated.append(log)
    return rotated
