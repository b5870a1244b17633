"""Free loopback ports, for tests and benchmarks that start their own runtime beside a user's."""
from __future__ import annotations

import random
import socket
from collections import deque
from pathlib import Path

# The runtime puts virtual server i's KeysManager on QUART_KEYSMANAGER_PORT + i and the model store
# after them, so a port handed out here comes with this many free successors.
SUCCESSORS = 16
_LOWEST = 10000
# Blocks handed out lately in this process: nothing is bound on them until the runtime starts, so
# without this a test's KeysManager block could take the Redis port picked the line before.
_recent: deque[int] = deque(maxlen=256)


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free with its SUCCESSORS next ports, below the kernel's ephemeral range.

    Not a port the kernel picks (bind to 0): those come from the ephemeral range, where a
    successor of one may be a client connection's local port by the time the runtime binds it
    (a clean-clone test run failed so: "address already in use")."""
    top = _ephemeral_low() - SUCCESSORS - 1
    if top <= _LOWEST:  # the whole range is ephemeral on this host: successors are a matter of luck
        top = 65535 - SUCCESSORS
    for _ in range(1000):
        base = random.randrange(_LOWEST, top)
        if any(abs(base - other) <= SUCCESSORS for other in _recent):
            continue
        if all(_bindable(host, port) for port in range(base, base + SUCCESSORS + 1)):
            _recent.append(base)
            return base
    raise RuntimeError(f"no {SUCCESSORS + 1} consecutive free ports on {host} in {_LOWEST}–{top + SUCCESSORS}")


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _ephemeral_low() -> int:
    try:  # Linux; elsewhere IANA's dynamic range
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152
