"""The KV budget's accounting and the sampler's determinism."""
from __future__ import annotations

import pytest
import torch

from models.kv_cache import KVShape, KVStore, NoRoom, split_cache
from models.sampling import Sampling, next_token

SHAPE = KVShape(layers=2, kv_heads=3, head_dim=4, dtype=torch.float32)


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


def test_idle_sequences_expire():
    store = KVStore(SHAPE, budget_bytes=10 ** 6)
    store.admit("old", 10)
    store.sequences["old"].touched -= 100
    store.admit("new", 10)
    assert store.expire(50) == ["old"] and list(store.sequences) == ["new"]


def test_an_exported_cache_is_adopted_whole():
    store, other = KVStore(SHAPE, 10 ** 6), KVStore(SHAPE, 10 ** 6)
    seq = store.admit("a", 10)
    for t in seq.keys + seq.values:
        t.normal_()
    seq.length = 6
    copy = other.adopt("a", 10, store.export("a"))
    assert copy.length == 6
    assert all(torch.equal(a[:, :, :6], b[:, :, :6]) for a, b in zip(seq.keys + seq.values, copy.keys + copy.values))
    with pytest.raises(ValueError):
        other.adopt("b", 10, {"k0": torch.zeros(1, 3, 4, 4)})


def test_caches_named_by_model_layer_gather_into_a_wider_store_and_split_back():
    """Two stores of 2 layers each (the model's layers 4-5 and 6-7) exported by the model's layer
    index fill one store of 4 layers (4-7), which splits back into the two the same."""
    narrow = [KVStore(SHAPE, 10 ** 6), KVStore(SHAPE, 10 ** 6)]
    wide = KVStore(KVShape(2 * SHAPE.layers, SHAPE.kv_heads, SHAPE.head_dim, SHAPE.dtype), 10 ** 6)
    gathered = {}
    for i, store in enumerate(narrow):
        seq = store.admit("a", 10)
        for t in seq.keys + seq.values:
            t.normal_()
        seq.length = 5
        gathered.update(store.export("a", first_layer=4 + 2 * i))
    assert sorted(gathered) == ["k4", "k5", "k6", "k7", "v4", "v5", "v6", "v7"]
    whole = wide.adopt("a", 10, gathered, first_layer=4)
    assert whole.length == 5
    assert torch.equal(whole.keys[3][:, :, :5], narrow[1].sequences["a"].keys[1][:, :, :5])
    back = KVStore(SHAPE, 10 ** 6).adopt("a", 10, wide.export("a", first_layer=4), first_layer=6)
    assert torch.equal(back.values[0][:, :, :5], narrow[1].sequences["a"].values[0][:, :, :5])
    cache, inputs = split_cache({**gathered, "hidden": torch.zeros(1), "kv": torch.zeros(1)})
    assert sorted(inputs) == ["hidden", "kv"] and cache.keys() == gathered.keys()
    with pytest.raises(KeyError):
        wide.adopt("b", 10, narrow[0].export("a", first_layer=0), first_layer=4)


def test_greedy_is_the_argmax_and_sampling_is_reproducible():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert next_token(logits, Sampling(), 5) == 1
    hot = Sampling(temperature=1.0, top_p=1.0, seed=42)
    draws = [next_token(logits, hot, p) for p in range(50)]
    assert draws == [next_token(logits, hot, p) for p in range(50)]
    assert len(set(draws)) > 1
    nucleus = Sampling(temperature=1.0, top_p=0.5, seed=1)
    assert {next_token(logits, nucleus, p) for p in range(50)} == {1}
