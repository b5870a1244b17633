"""Secrets kept in files under the runtime's home (OpenFaaS's basic-auth-password, the Redis
password, the internal token), and the bearer check every internal HTTP API makes."""
from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path


def read_or_create_secret(path: Path) -> str:
    """The secret in `path`, created on first use and readable only by its owner. Two processes
    that create it at once both end up with the one that was written first."""
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    value = secrets.token_urlsafe(24)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_text().strip()
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    return value


def bearer(token: str) -> dict[str, str]:
    """The header an internal client sends."""
    return {"Authorization": f"Bearer {token}"}


def bearer_ok(header: str | None, token: str) -> bool:
    """Whether an Authorization header carries `token` (compared in constant time)."""
    scheme, _, value = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), token.encode())
