"""The keys and values one stage replica keeps for the requests whose prefill it ran.

Each sequence reserves its whole capacity (prompt plus the tokens it may generate) when it is
admitted, so the budget in bytes is checked once, up front: a request that does not fit waits or
is refused, and no later decode step can run the replica out of memory."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


class NoRoom(Exception):
    """The KV budget cannot hold a new sequence now."""


@dataclass
class Sequence:
    seq_id: str
    capacity: int
    keys: list[torch.Tensor]      # per layer: [1, kv_heads, capacity, head_dim]
    values: list[torch.Tensor]
    nbytes: int
    length: int = 0               # positions filled
    touched: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class KVShape:
    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device = torch.device("cpu")

    @property
    def bytes_per_token(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.layers * self.kv_heads * self.head_dim * itemsize


class KVStore:
    def __init__(self, shape: KVShape, budget_bytes: int) -> None:
        self.shape = shape
        self.budget = budget_bytes
        self.sequences: dict[str, Sequence] = {}
        self.used = 0

    def need(self, capacity: int) -> int:
        return capacity * self.shape.bytes_per_token

    def fits_ever(self, capacity: int) -> bool:
        return self.need(capacity) <= self.budget

    def admit(self, seq_id: str, capacity: int) -> Sequence:
        """A new, empty sequence (replacing one of the same id: a prefill run again)."""
        self.free(seq_id)
        nbytes = self.need(capacity)
        if self.used + nbytes > self.budget:
            raise NoRoom(f"{nbytes} bytes wanted, {self.budget - self.used} of {self.budget} free")
        s = self.shape
        dims = (1, s.kv_heads, capacity, s.head_dim)
        seq = Sequence(seq_id, capacity,
                       [torch.empty(dims, dtype=s.dtype, device=s.device) for _ in range(s.layers)],
                       [torch.empty(dims, dtype=s.dtype, device=s.device) for _ in range(s.layers)], nbytes)
        self.sequences[seq_id] = seq
        self.used += nbytes
        return seq

    def get(self, seq_id: str) -> Sequence | None:
        seq = self.sequences.get(seq_id)
        if seq is not None:
            seq.touched = time.monotonic()
        return seq

    def fork(self, parent_id: str, seq_id: str, capacity: int, length: int) -> Sequence:
        """A new sequence holding a copy of the first `length` positions of another (the prompt
        that several choices of one request share). KeyError if the parent is gone or shorter;
        NoRoom if the copy does not fit."""
        parent = self.sequences.get(parent_id)
        if parent is None or parent.length < length or length > capacity:
            raise KeyError(f"no sequence {parent_id} of {length} positions to fork")
        seq = self.admit(seq_id, capacity)
        for mine, theirs in zip(seq.keys + seq.values, parent.keys + parent.values):
            mine[:, :, :length] = theirs[:, :, :length]
        seq.length = length
        return seq

    def free(self, seq_id: str) -> bool:
        seq = self.sequences.pop(seq_id, None)
        if seq is None:
            return False
        self.used -= seq.nbytes
        return True

    def expire(self, idle_s: float) -> list[str]:
        """Frees the sequences no step touched for `idle_s` (their entry gave up or died)."""
        cutoff = time.monotonic() - idle_s
        gone = [sid for sid, seq in self.sequences.items() if seq.touched < cutoff]
        for sid in gone:
            self.free(sid)
        return gone

    # -- migration: a sequence as plain tensors and back --------------------------------------
    # Cache tensors are named by the model's layer index ("k12", "v12"), not the replica's, so a
    # message may carry the cache of several stages: a replica of a wider range gathers them
    # (consolidation), one of a narrower range takes its own and hands the rest on (a split).

    def export(self, seq_id: str, first_layer: int = 0) -> dict[str, torch.Tensor]:
        """The filled part of a sequence's cache, layer by layer, to send to another replica."""
        seq = self.sequences[seq_id]
        out = {}
        for i, (k, v) in enumerate(zip(seq.keys, seq.values)):
            out[f"k{first_layer + i}"] = k[:, :, :seq.length]
            out[f"v{first_layer + i}"] = v[:, :, :seq.length]
        return out

    def adopt(self, seq_id: str, capacity: int, tensors: dict[str, torch.Tensor], first_layer: int = 0) -> Sequence:
        """Installs this replica's layers of a sequence exported elsewhere (NoRoom if it does not
        fit; ValueError if a layer is missing or misshapen)."""
        length = tensors[f"k{first_layer}"].shape[2]
        want = (1, self.shape.kv_heads, length, self.shape.head_dim)
        for i in range(first_layer, first_layer + self.shape.layers):
            for name in (f"k{i}", f"v{i}"):
                t = tensors.get(name)
                if t is None or tuple(t.shape) != want:
                    raise ValueError(f"migrated cache tensor {name} is missing or has the wrong shape")
        if length > capacity:
            raise ValueError(f"migrated cache holds {length} positions, more than its capacity {capacity}")
        seq = self.admit(seq_id, capacity)
        for i in range(self.shape.layers):
            seq.keys[i][:, :, :length] = tensors[f"k{first_layer + i}"]
            seq.values[i][:, :, :length] = tensors[f"v{first_layer + i}"]
        seq.length = length
        return seq


def split_cache(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A message's tensors as (cache tensors, the step's own inputs)."""
    cache = {k: v for k, v in tensors.items() if k[:1] in ("k", "v") and k[1:].isdigit()}
    return cache, {k: v for k, v in tensors.items() if k not in cache}
