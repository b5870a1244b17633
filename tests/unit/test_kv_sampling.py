"""The KV budget's accounting and the sampler's determinism."""
from __future__ import annotations

import pytest
import torch

from models.kv_cache import BLOCK, KVShape, KVStore, NoRoom, Sequence, split_cache
from models.sampling import Sampling, all_finite, next_token

SHAPE = KVShape(layers=2, kv_heads=3, head_dim=4, dtype=torch.float32)


def fill(store: KVStore, seq_id: str, capacity: int, length: int) -> Sequence:
    """A sequence of `length` random positions."""
    seq = store.admit(seq_id, capacity)
    dims = (1, SHAPE.kv_heads, length, SHAPE.head_dim)
    for layer in range(SHAPE.layers):
        store.write(seq, layer, 0, torch.randn(dims), torch.randn(dims))
    seq.length = length
    return seq


def test_a_sequence_reserves_its_whole_capacity_and_frees_it():
    store = KVStore(SHAPE, budget_bytes=SHAPE.bytes_per_token * 100)
    assert SHAPE.bytes_per_token == 2 * 2 * 3 * 4 * 4
    store.admit("a", 60)
    assert store.used == 60 * SHAPE.bytes_per_token
    with pytest.raises(NoRoom):
        store.admit("b", 41)
    store.admit("b", 40)
    assert store.free("a") and not store.free("a")
    assert store.used == 40 * SHAPE.bytes_per_token
    assert not store.fits_ever(101) and store.fits_ever(100)


def test_admitting_an_id_again_replaces_it():
    store = KVStore(SHAPE, budget_bytes=SHAPE.bytes_per_token * 100)
    store.admit("a", 60)
    store.admit("a", 50)
    assert store.used == 50 * SHAPE.bytes_per_token and len(store.sequences) == 1


def test_sequences_share_the_pool_without_touching_each_others_positions():
    """Capacities that are not whole blocks (rounded up in the pool, not in the budget), freed and
    reused blocks, and a pool that grows past what the budget's bytes alone would hold: every
    sequence reads back exactly what was written to it."""
    store = KVStore(SHAPE, budget_bytes=SHAPE.bytes_per_token * 4 * BLOCK)
    first = [fill(store, str(i), BLOCK // 2 + 1, BLOCK // 2) for i in range(5)]
    kept = {seq.seq_id: [store.read(seq, layer, seq.length) for layer in range(SHAPE.layers)] for seq in first}
    assert len({b for seq in first for b in seq.blocks}) == 5, "each sequence holds its own block"
    for seq in first[:3]:
        store.free(seq.seq_id)
        del kept[seq.seq_id]
    again = [fill(store, f"n{i}", BLOCK + 3, BLOCK + 2) for i in range(2)]
    kept.update({seq.seq_id: [store.read(seq, layer, seq.length) for layer in range(SHAPE.layers)] for seq in again})
    for sid, layers in kept.items():
        seq = store.sequences[sid]
        assert all(torch.equal(a, b) for layer, pair in enumerate(layers)
                   for a, b in zip(pair, store.read(seq, layer, seq.length))), sid


def test_scattered_blocks_read_back_as_consecutive_ones_do():
    """A sequence on consecutive blocks is read as a slice of the pool, one on blocks freed by
    others in between as a gather: the same values either way, an export a copy in both."""
    store = KVStore(SHAPE, budget_bytes=SHAPE.bytes_per_token * 4 * BLOCK)
    a, b, c = (fill(store, name, BLOCK, BLOCK) for name in "abc")
    store.free("a")
    store.free("c")
    scattered = fill(store, "d", 2 * BLOCK, 2 * BLOCK - 1)
    assert a.base is not None and scattered.base is None and sorted(scattered.blocks) == sorted(a.blocks + c.blocks)
    for seq in (b, scattered):
        exported = store.export(seq.seq_id)
        for layer in range(SHAPE.layers):
            keys, _ = store.read(seq, layer, seq.length)
            assert torch.equal(keys[0].transpose(0, 1), store.keys[layer][seq.slots[:seq.length]])
            assert torch.equal(exported[f"k{layer}"], keys)
        exported["k0"].zero_()
        assert not store.read(seq, 0, seq.length)[0].eq(0).all(), "an export shares memory with the pool"


def test_a_new_sequence_reads_zeros_where_a_freed_one_left_nan():
    """A compiled step reads past a sequence's length (masked out), where a mask's zero weight
    times NaN would still be NaN: a sequence starts with every position zeroed."""
    store = KVStore(SHAPE, budget_bytes=SHAPE.bytes_per_token * BLOCK)
    old = store.admit("old", BLOCK)
    nan = torch.full((1, SHAPE.kv_heads, BLOCK, SHAPE.head_dim), float("nan"))
    for layer in range(SHAPE.layers):
        store.write(old, layer, 0, nan, nan)
    store.free("old")
    new = store.admit("new", BLOCK)
    assert new.blocks == old.blocks
    assert all(t.eq(0).all() for layer in range(SHAPE.layers) for t in store.read(new, layer, BLOCK))


def test_a_forked_sequence_copies_the_prompt_and_then_goes_its_own_way():
    store = KVStore(SHAPE, budget_bytes=10 ** 6)
    parent = fill(store, "p", 40, 20)
    child = store.fork("p", "c", 40, 20)
    assert not set(child.blocks) & set(parent.blocks)
    assert torch.equal(store.read(child, 1, 20)[0], store.read(parent, 1, 20)[0])
    store.write(child, 1, 20, torch.ones(1, SHAPE.kv_heads, 1, SHAPE.head_dim), torch.ones(1, SHAPE.kv_heads, 1, SHAPE.head_dim))
    store.write(parent, 1, 20, torch.zeros(1, SHAPE.kv_heads, 1, SHAPE.head_dim), torch.zeros(1, SHAPE.kv_heads, 1, SHAPE.head_dim))
    assert store.read(child, 1, 21)[0][:, :, 20].eq(1).all() and store.read(parent, 1, 21)[0][:, :, 20].eq(0).all()


def test_idle_sequences_expire():
    store = KVStore(SHAPE, budget_bytes=10 ** 6)
    store.admit("old", 10)
    store.sequences["old"].touched -= 100
    store.admit("new", 10)
    assert store.expire(50) == ["old"] and list(store.sequences) == ["new"]


def test_an_exported_cache_is_adopted_whole():
    store, other = KVStore(SHAPE, 10 ** 6), KVStore(SHAPE, 10 ** 6)
    seq = fill(store, "a", 10, 6)
    copy = other.adopt("a", 10, store.export("a"))
    assert copy.length == 6
    assert all(torch.equal(a, b) for layer in range(SHAPE.layers)
               for a, b in zip(store.read(seq, layer, 6), other.read(copy, layer, 6)))
    with pytest.raises(ValueError):
        other.adopt("b", 10, {"k0": torch.zeros(1, 3, 4, 4)})


def test_caches_named_by_model_layer_gather_into_a_wider_store_and_split_back():
    """Two stores of 2 layers each (the model's layers 4-5 and 6-7) exported by the model's layer
    index fill one store of 4 layers (4-7), which splits back into the two the same."""
    narrow = [KVStore(SHAPE, 10 ** 6), KVStore(SHAPE, 10 ** 6)]
    wide = KVStore(KVShape(2 * SHAPE.layers, SHAPE.kv_heads, SHAPE.head_dim, SHAPE.dtype), 10 ** 6)
    gathered = {}
    for i, store in enumerate(narrow):
        fill(store, "a", 10, 5)
        gathered.update(store.export("a", first_layer=4 + 2 * i))
    assert sorted(gathered) == ["k4", "k5", "k6", "k7", "v4", "v5", "v6", "v7"]
    whole = wide.adopt("a", 10, gathered, first_layer=4)
    assert whole.length == 5
    assert torch.equal(wide.read(whole, 3, 5)[0], narrow[1].read(narrow[1].sequences["a"], 1, 5)[0])
    back_store = KVStore(SHAPE, 10 ** 6)
    back = back_store.adopt("a", 10, wide.export("a", first_layer=4), first_layer=6)
    assert torch.equal(back_store.read(back, 0, 5)[1], narrow[1].read(narrow[1].sequences["a"], 0, 5)[1])
    cache, inputs = split_cache({**gathered, "hidden": torch.zeros(1), "kv": torch.zeros(1)})
    assert sorted(inputs) == ["hidden", "kv"] and cache.keys() == gathered.keys()
    with pytest.raises(KeyError):
        wide.adopt("b", 10, narrow[0].export("a", first_layer=0), first_layer=4)


def test_greedy_is_the_argmax_and_sampling_is_reproducible():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert next_token(logits, Sampling(), 5) == 1
    tied = torch.tensor([0.5, 2.0, -1.0, 2.0, 2.0]).to(torch.bfloat16)
    assert next_token(tied, Sampling(), 5) == 1   # the first of equal maxima, as torch.argmax
    hot = Sampling(temperature=1.0, top_p=1.0, seed=42)
    draws = [next_token(logits, hot, p) for p in range(50)]
    assert draws == [next_token(logits, hot, p) for p in range(50)]
    assert len(set(draws)) > 1
    nucleus = Sampling(temperature=1.0, top_p=0.5, seed=1)
    assert {next_token(logits, nucleus, p) for p in range(50)} == {1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_are_finite_only_without_nan_or_infinity(dtype):
    logits = torch.randn(49152).to(dtype)
    assert all_finite(logits)
    for bad in (float("nan"), float("inf"), float("-inf")):
        broken = logits.clone()
        broken[31000] = bad
        assert not all_finite(broken)
