"""The batch sizes a compiled decode step runs at (models/compiled_decode.py), apart from torch so
that the simulator prices a batch as the replica runs it (sim/step_cost.py).

Up to FEW_ROWS sequences, a step's linear layers are one reduction per row over the plain weight,
which reads each weight once for every row (models/packed_linear.py); torch unrolls the rows, so
each size is a graph of its own. A batch runs padded to the next size of BUCKETS, which keeps
those graphs to a few; a larger batch runs as it is, through one graph for every size past them."""
from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")

FEW_ROWS = 8
BUCKETS = tuple(b for b in (2, 4, 8, 16, 32) if b < FEW_ROWS) + (FEW_ROWS,)
# The batch sizes a compile traces: one sequence, each bucket, and one past them.
WARM_BATCHES = (1, *BUCKETS, FEW_ROWS + 1)


def bucket(batch: int) -> int:
    """The size a batch of `batch` decode steps runs at."""
    return next((b for b in BUCKETS if b >= batch), batch) if batch > 1 else batch


def padded(steps: list[T]) -> list[T]:
    """A batch as it runs: padded to its bucket by repeating the last step, which writes what
    that step writes, where it does."""
    return steps + steps[-1:] * (bucket(len(steps)) - len(steps))
