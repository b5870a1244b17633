"""What a running provider leaves in `<home>/run/state.json` for one started in its place after it
died (runtime/guardian.py starts it): the supervised components' pids and every function's
deployment, desired replicas and replicas (pid, start time, port, server). The new provider adopts
what still runs instead of starting it again, so the runtime serves again in seconds."""
from __future__ import annotations

import json
import os
from pathlib import Path


def state_path(home: str | Path) -> Path:
    return Path(home) / "run" / "state.json"


def save(path: Path, state: dict) -> None:
    """Written whole or not at all: a provider killed mid-write leaves the previous state."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(state, f)
    os.replace(tmp, path)


def load(path: Path) -> dict:
    """The state a provider left; empty when there is none or it cannot be read."""
    try:
        state = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}
