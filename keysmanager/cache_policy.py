"""Which zygotes make room for a new one: the KeysManager's cache decision as a pure function,
so the live KeysManager and the cluster simulator decide the same way."""
from __future__ import annotations

from dataclasses import dataclass


class OverBudget(RuntimeError):
    """The stage range does not fit in the server's cache budget, even after evicting every
    idle zygote that is not a key stage."""


@dataclass(frozen=True, slots=True)
class Held:
    key: str            # "model:stages"
    bytes: int
    last_use: float
    forking: bool = False


def evictions(held: list[Held], key_stages: set[str], budget: int, size: int) -> list[str]:
    """Keys to evict, least recently used first, so that `size` more bytes fit in `budget`.
    Key stages and zygotes being forked from stay; when even evicting every other one would
    not make room, refuses before anything is evicted for nothing. A budget <= 0 is unlimited."""
    if budget <= 0:
        return []
    idle = sorted((h for h in held if not h.forking and h.key not in key_stages), key=lambda h: h.last_use)
    total = sum(h.bytes for h in held)
    kept = total - sum(h.bytes for h in idle)
    if kept + size > budget:
        raise OverBudget(f"{size} B do not fit: {kept} of {budget} B are held by key stages "
                         "or zygotes being forked from")
    out = []
    for h in idle:
        if total + size <= budget:
            break
        out.append(h.key)
        total -= h.bytes
    return out
