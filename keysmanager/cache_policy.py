"""Which zygotes make room for a new one: the KeysManager's cache decision as a pure function,
so the live KeysManager and the cluster simulator decide the same way."""
from __future__ import annotations

from dataclasses import dataclass

# Zygotes a server's KeysManager warms at once at start: each is mostly waiting (its imports, its
# shard's read), so several overlap well (the runtime's start and the simulator's both use it).
WARMING_AT_ONCE = 4


class OverBudget(RuntimeError):
    """The stage range does not fit in the server's cache budget, even after evicting every
    idle zygote that is not a key stage."""


@dataclass(frozen=True, slots=True)
class Held:
    key: str            # "model:stages"
    bytes: int
    last_use: float
    forking: bool = False
    cached_at: float = float("-inf")


def evictions(held: list[Held], key_stages: set[str], budget: int, size: int, now: float = 0.0,
              min_residency_s: float = 0.0) -> list[str]:
    """Keys to evict, least recently used first, so that `size` more bytes fit in `budget`.
    Key stages, zygotes being forked from, and zygotes cached less than `min_residency_s` ago
    stay (the last: a stage that is key one tick and not the next does not evict what was just
    cached for it, churning the cache so forks fall back to cold starts); when even evicting
    every other one would not make room, refuses before anything is evicted for nothing. A
    budget <= 0 is unlimited."""
    if budget <= 0:
        return []
    idle = sorted((h for h in held if not h.forking and h.key not in key_stages
                   and now - h.cached_at >= min_residency_s), key=lambda h: h.last_use)
    total = sum(h.bytes for h in held)
    kept = total - sum(h.bytes for h in idle)
    if kept + size > budget:
        raise OverBudget(f"{size} B do not fit: {kept} of {budget} B are held by key stages, "
                         "zygotes being forked from, or ones cached too recently to evict")
    out = []
    for h in idle:
        if total + size <= budget:
            break
        out.append(h.key)
        total -= h.bytes
    return out
