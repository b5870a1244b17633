"""How a generative stage replica forms its next batch and where a draining one sends its
caches: pure rules the live replica and the cluster simulator both follow."""
from __future__ import annotations

from collections.abc import Mapping

# With decode steps always waiting, a new request still enters a batch at least every this many steps.
PREFILL_EVERY = 4


def new_item_slots(max_batch: int, decode_steps: int, steps_without_new: int) -> int:
    """How many new requests (prefills from the stage's shared queue) join a batch that already
    holds `decode_steps` decode steps: the slots left, or one when decodes have filled every
    batch for PREFILL_EVERY steps, so that new requests never starve."""
    slots = max_batch - decode_steps
    if slots <= 0 and steps_without_new >= PREFILL_EVERY:
        return 1
    return max(0, slots)


def migration_peer(sequences: Mapping[str, int]) -> str | None:
    """Of a draining replica's live, not draining peers (replica -> sequences it holds), the one
    holding the fewest takes its caches; None when it has no peer (it finishes them itself)."""
    return min(sequences, key=lambda r: (sequences[r], r)) if sequences else None
