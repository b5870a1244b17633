"""Which cores a replica is pinned to when the compensator gives it c CPUs: disjoint from the
other pinned replicas on its server where enough cores are free, else the least shared ones
(QUART Algorithm 1 allocates each replica CPUs of its own; pinning every replica to the lowest
cores, as before, stacked them all on the same ones). Pure."""
from __future__ import annotations

from collections import Counter


def pick_cores(host: list[int], others: list[list[int]], want: int) -> list[int]:
    """`want` of the host's cores (at least one, at most all), the least held by `others` first,
    then the lowest; in ascending order."""
    held = Counter(c for cores in others for c in cores)
    want = max(1, min(want, len(host)))
    return sorted(sorted(host, key=lambda c: (held[c], c))[:want])
