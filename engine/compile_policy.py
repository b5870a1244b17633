"""When a replica's background compile starts: a pure rule, so that a model woken from zero
answers its first burst on eager steps instead of sharing its cores with a compiler."""
from __future__ import annotations

# How long a replica must have run no step, holding no sequence, to count as idle.
QUIET_S = 1.0


def compile_may_start(waited_s: float, idle_s: float | None, holding: bool, defer_s: float) -> bool:
    """Whether a compile that has waited `waited_s` starts now: once the replica idles (holds
    no sequence and ran no step for QUIET_S; `idle_s` None: it has run none yet, and a replica
    just started is about to get work), or at the latest after `defer_s`, since under steady
    load a compiled step (about 0.87× an eager token here) is worth the compile's cost."""
    return waited_s >= defer_s or (not holding and idle_s is not None and idle_s >= QUIET_S)
