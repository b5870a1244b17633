"""HydraServe's network-contention-aware rule for cold starts (HydraServe §4.2, Eq. 3-4).

Cold starts on one server share its bandwidth B equally. A new one is admitted only if every
fetch, the new one included, still meets its deadline at the smaller share B / (N + 1)."""
from __future__ import annotations

from scheduler.state import Fetch


def admits(fetches: tuple[Fetch, ...], bandwidth: float, new: Fetch, now: float) -> bool:
    """Eq. 3 for every fetch under way and the new one: S_i <= B / (N + 1) * (D_i - T)."""
    share = bandwidth / (len(fetches) + 1)
    return all(f.pending_bytes <= share * (f.deadline - now) for f in (*fetches, new))


def progress(fetches: tuple[Fetch, ...], bandwidth: float, since: float, now: float) -> tuple[Fetch, ...]:
    """Eq. 4: what is left of each fetch after sharing B between them from `since` to `now`;
    fetches that are done (S' <= 0) are dropped."""
    if not fetches:
        return ()
    read = bandwidth / len(fetches) * max(0.0, now - since)
    return tuple(Fetch(f.pending_bytes - read, f.deadline) for f in fetches if f.pending_bytes - read > 0)
