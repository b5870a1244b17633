"""How a generative stage replica forms its next batch and where a draining one sends its
caches: pure rules the live replica and the cluster simulator both follow."""
from __future__ import annotations

from collections.abc import Mapping

# How a draining replica hands over the sequences it holds: their caches go to the peer with the
# next step (a peer of a narrower range keeps its layers and passes the rest on), or, to a peer of
# a wider range, each holder runs the step and sends its cache on with it.
MIGRATE, GATHER = "migrate", "gather"

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


def batch_limit(max_batch: int, few_rows: int | None) -> int:
    """The most items a replica runs in one step: `max_batch`, or at most `few_rows` where its
    compiled decode steps multiply that many rows as reductions over the plain weight and more
    through the packed kernel (models/packed_linear.py). Two steps of a few read each weight twice
    and cost less than one step past them: on the 2-core AVX2 EPYC (float32, one thread a stage),
    16 concurrent requests made 1.15 and 1.29x the tokens a second in batches of at most 8 (a
    stage's two groups of 8, where they had been about 11 and 5), side by side in two rounds."""
    return min(max_batch, few_rows) if few_rows else max_batch


def migration_peer(sequences: Mapping[str, int]) -> str | None:
    """Of a draining replica's live, not draining peers (replica -> sequences it holds), the one
    holding the fewest takes its caches; None when it has no peer (it finishes them itself)."""
    return min(sequences, key=lambda r: (sequences[r], r)) if sequences else None


def still_fed(readers: int, upstream: int, unread: int) -> bool:
    """Whether a draining replica must still take new items from its stage's stream: when no
    replica that is not draining reads that stream (`readers`), and work may yet arrive there:
    a replica of an earlier stage is still registered (it forwards what it holds or takes, as a
    consolidating pipeline's stage 0 does while the later stages drain) or items wait unread.
    Otherwise what an upstream replica forwards would wait in a stream nobody reads."""
    return readers == 0 and (upstream > 0 or unread > 0)


def handover_peer(last: int, peers: Mapping[str, tuple[int, int]]) -> tuple[str, str] | None:
    """Of a draining replica's live, not draining peers starting at its stage (replica ->
    (end of its range, sequences it holds)): the one taking its sequences, and how. A wider peer
    first (the pipeline is consolidating: the caches are gathered to it), then one of the same
    range, then a narrower one (the model splits again: it keeps its layers, passes the rest on);
    the fewest sequences among equals. None without a peer (the replica finishes them itself)."""
    for fits, how in ((lambda end: end > last, GATHER), (lambda end: end == last, MIGRATE),
                      (lambda end: end < last, MIGRATE)):
        chosen = migration_peer({r: seqs for r, (end, seqs) in peers.items() if fits(end)})
        if chosen is not None:
            return chosen, how
    return None
