"""Every supported family, split, computes what its unsplit transformers model computes: random
weights that transformers' own config classes and save_pretrained write (the real checkpoint
files and loading code), partitioned at 1, 2 and 4 stages and run through the KV-cache data plane
(`BatchedDecoder`) as the stage replicas run it."""
from __future__ import annotations

import json

import pytest
import torch

from models.architectures import architecture
from models.batched_decoder import BatchedDecoder, Step
from models.families import DECODER, FAMILIES
from models.kv_cache import KVStore
from models.partition import partition
from models.random_checkpoint import write_random_checkpoint
from models.sources import SourceError, open_checkpoint, resolve
from models.stage_runner import StageRunner
from tests.live.runtime_helpers import greedy_reference

DECODERS = sorted(t for t, kind in FAMILIES.items() if kind == DECODER)
ENCODERS = sorted(t for t, kind in FAMILIES.items() if kind != DECODER)
# Longer than the sliding windows of the random Mistral and Gemma checkpoints (6 positions), so
# prefill and decode both cross them.
PROMPT = [5, 17, 300, 42, 7, 99, 1000, 12, 31]
NEW = 8


@pytest.fixture(scope="module")
def cache(home_settings):
    return home_settings.models_dir / "_sources"


def engines(manifest, dtype: str = "float32") -> list[BatchedDecoder]:
    return [BatchedDecoder(StageRunner(manifest, i, i + 1, dtype=dtype).modules) for i in range(manifest.num_stages)]


def greedy_cached(chain: list[BatchedDecoder], prompt: list[int], new: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens through the stages with their KV caches, and the first step's logits."""
    seqs = [KVStore(e.kv_shape(), 1 << 30).admit("s", len(prompt) + new) for e in chain]
    inputs, start, tokens, first = torch.tensor(prompt), 0, [], None
    for _ in range(new):
        x = inputs
        for engine, seq in zip(chain, seqs):
            x = engine.forward([Step(seq, x, start)])[0]
        first = x if first is None else first
        tokens.append(int(x.argmax()))
        start += inputs.shape[0]
        inputs = torch.tensor([tokens[-1]])
    return tokens, first


@pytest.mark.parametrize("model_type", DECODERS)
def test_a_split_decoder_generates_what_the_unsplit_one_does(model_type, cache, tmp_path):
    ckpt = resolve(f"random-{model_type}", cache, seed=1)
    expected, expected_logits = greedy_reference(ckpt.arch.reference(ckpt.folder), PROMPT, NEW)
    for stages in (1, 2, 4):
        manifest = partition(ckpt, stages, tmp_path / f"{model_type}-{stages}")
        got, logits = greedy_cached(engines(manifest), PROMPT, NEW)
        assert got == expected, (model_type, stages)
        assert (logits - expected_logits).abs().max().item() <= 1e-4


@pytest.mark.parametrize("model_type", DECODERS)
def test_eight_sequences_in_one_step_equal_each_alone(model_type, cache, tmp_path):
    manifest = partition(resolve(f"random-{model_type}", cache, seed=2), 2, tmp_path / model_type)
    chain = engines(manifest)
    prompts = [PROMPT[: 2 + i] + [i + 3] for i in range(8)]
    alone = [greedy_cached(chain, p, 4)[0] for p in prompts]
    stores = [KVStore(e.kv_shape(), 1 << 30) for e in chain]
    seqs = [[store.admit(str(i), len(p) + 4) for store in stores] for i, p in enumerate(prompts)]
    inputs, starts = [torch.tensor(p) for p in prompts], [0] * 8
    together: list[list[int]] = [[] for _ in prompts]
    for _ in range(4):
        xs = inputs
        for k, engine in enumerate(chain):
            xs = engine.forward([Step(seqs[i][k], xs[i], starts[i]) for i in range(8)])
        for i, logits in enumerate(xs):
            together[i].append(int(logits.argmax()))
            starts[i] += inputs[i].shape[0]
        inputs = [torch.tensor([t[-1]]) for t in together]
    assert together == alone


@pytest.mark.parametrize("model_type", ["qwen2", "gemma2"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_checkpoints_run_in_their_own_dtype(model_type, dtype, cache, tmp_path):
    """QUART_DTYPE=auto keeps a checkpoint's dtype, the KV cache too; the split generates what the
    unsplit model does in that dtype, and stays close to transformers' model in that dtype (not
    equal: this project's attention computes its scores in float32 on the CPU)."""
    folder = write_random_checkpoint(model_type, cache, seed=4, dtype=dtype)
    ckpt = open_checkpoint(f"{model_type}-{dtype}", folder)
    assert ckpt.dtype == dtype
    manifest = partition(ckpt, 2, tmp_path / model_type)
    assert manifest.dtype == dtype
    chain = engines(manifest, "auto")
    assert chain[0].kv_shape().dtype == getattr(torch, dtype)
    whole = engines(partition(ckpt, 1, tmp_path / f"{model_type}-1"), "auto")
    got, logits = greedy_cached(chain, PROMPT, NEW)
    assert got == greedy_cached(whole, PROMPT, NEW)[0]
    _, expected = greedy_reference(ckpt.arch.reference(folder, getattr(torch, dtype)), PROMPT, 1)
    assert int(logits.argmax()) == int(expected.argmax())
    assert (logits.float() - expected).abs().max().item() <= 0.05 * expected.abs().max().item()
    # Asked for float32, the same shards run widened.
    assert engines(manifest, "float32")[1].kv_shape().dtype == torch.float32


def test_a_sharded_checkpoint_is_read_through_its_index(cache, tmp_path):
    folder = write_random_checkpoint("qwen2", cache, seed=5, max_shard_size="20MB")
    assert (folder / "model.safetensors.index.json").is_file() and len(list(folder.glob("*.safetensors"))) >= 2
    ckpt = open_checkpoint("sharded", folder)
    manifest = partition(ckpt, 3, tmp_path / "sharded")
    expected, _ = greedy_reference(ckpt.arch.reference(folder), PROMPT, 4)
    assert greedy_cached(engines(manifest), PROMPT, 4)[0] == expected
    sizes = [s.bytes for s in manifest.stages]
    assert max(sizes) < 0.6 * sum(sizes)  # byte-balanced: no stage holds most of the model


def test_pickle_checkpoints_are_refused_naming_safetensors(tmp_path):
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (folder / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(SourceError, match="safetensors"):
        open_checkpoint("pickled", folder)


def test_an_unsupported_family_is_refused_naming_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="supported: .*qwen2"):
        open_checkpoint("gpt2", tmp_path)


def test_a_hub_id_resolves_from_the_hugging_face_cache(cache, tmp_path, monkeypatch):
    """huggingface_hub's own cache layout (models--org--name/snapshots/<rev>), offline."""
    snapshot = tmp_path / "hub" / "models--someone--tiny-qwen2" / "snapshots" / ("0" * 40)
    snapshot.parent.mkdir(parents=True)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0" * 40)
    import shutil
    shutil.copytree(write_random_checkpoint("qwen2", cache, seed=1), snapshot)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as constants
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    ckpt = resolve("someone/tiny-qwen2", cache)
    assert ckpt.model_type == "qwen2" and ckpt.folder == snapshot
    with pytest.raises(SourceError, match="cannot be reached"):
        resolve("someone/absent", cache)


@pytest.mark.parametrize("model_type", ENCODERS)
@pytest.mark.parametrize("stages", [1, 2, 4])
def test_a_split_encoder_embeds_what_the_unsplit_one_does(model_type, stages, cache, tmp_path):
    from models.architectures import pool
    ckpt = resolve(f"random-{model_type}", cache, seed=1)
    manifest = partition(ckpt, stages, tmp_path / model_type)
    assert manifest.pooling == {"mode": "mean", "normalize": True}
    ids = torch.tensor([[101, 7, 300, 42, 102, 0], [101, 9, 8, 102, 0, 0]])
    mask = (ids != 0).long()
    with torch.inference_mode():
        hidden = architecture(model_type).reference(ckpt.folder)(input_ids=ids, attention_mask=mask).last_hidden_state
        tensors = {"input_ids": ids, "attention_mask": mask}
        for i in range(manifest.num_stages):
            tensors = StageRunner(manifest, i, i + 1, dtype="float32").run(tensors)
    assert (tensors["embeddings"] - pool(hidden, mask)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("model_type", ["gemma2", "qwen3"])
def test_caches_move_between_layouts_mid_generation(model_type, cache, tmp_path):
    """Consolidation and split for a non-LLaMA family: the caches of a sequence prefilled by two
    stage replicas are gathered into one replica of the whole range, which decodes on; and its
    cache is split back over two stage replicas, which decode on. The tokens are those of the
    sequence that never moved."""
    manifest = partition(resolve(f"random-{model_type}", cache, seed=6), 2, tmp_path / model_type)
    stages = engines(manifest)
    whole = BatchedDecoder(StageRunner(manifest, 0, 2, dtype="float32").modules)
    expected, _ = greedy_cached(stages, PROMPT, 10)
    stores = [KVStore(e.kv_shape(), 1 << 30) for e in stages]
    seqs = [store.admit("s", len(PROMPT) + 10) for store in stores]
    x = torch.tensor(PROMPT)
    for engine, seq in zip(stages, seqs):
        x = engine.forward([Step(seq, x, 0)])[0]
    tokens = [int(x.argmax())]
    first_layers = [manifest.stages[i].layers[0] for i in range(2)]
    gathered = {k: v for store, first in zip(stores, first_layers) for k, v in store.export("s", first).items()}
    whole_store = KVStore(whole.kv_shape(), 1 << 30)
    seq = whole_store.adopt("s", len(PROMPT) + 10, gathered, first_layers[0])
    for _ in range(4):  # consolidated: one replica decodes
        out = whole.forward([Step(seq, torch.tensor([tokens[-1]]), seq.length)])[0]
        tokens.append(int(out.argmax()))
    exported = whole_store.export("s", first_layers[0])
    split = [KVStore(e.kv_shape(), 1 << 30).adopt("s", len(PROMPT) + 10, exported, first)
             for e, first in zip(stages, first_layers)]
    for _ in range(5):  # split again: two replicas decode
        x = torch.tensor([tokens[-1]])
        start = split[0].length
        for engine, s in zip(stages, split):
            x = engine.forward([Step(s, x, start)])[0]
        tokens.append(int(x.argmax()))
    assert tokens == expected


@pytest.mark.parametrize("model_type", ["gemma3_text", "phi3"])
def test_a_forked_prompt_cache_decodes_as_its_own_prefill(model_type, cache, tmp_path):
    """The choices of one request share its prompt's prefill: a sequence forked from another's
    first positions (at every stage) decodes what a sequence that prefilled itself does, whatever
    the parent decoded meanwhile."""
    manifest = partition(resolve(f"random-{model_type}", cache, seed=8), 2, tmp_path / model_type)
    chain = engines(manifest)
    stores = [KVStore(e.kv_shape(), 1 << 30) for e in chain]
    parents = [store.admit("p", len(PROMPT) + 6) for store in stores]
    x = torch.tensor(PROMPT)
    for engine, seq in zip(chain, parents):
        x = engine.forward([Step(seq, x, 0)])[0]
    first = int(x.argmax())
    y = torch.tensor([first])
    for engine, seq in zip(chain, parents):  # the parent moves on before the fork
        y = engine.forward([Step(seq, y, len(PROMPT))])[0]
    children = [store.fork("p", "c", len(PROMPT) + 6, len(PROMPT)) for store in stores]
    tokens, start = [first], len(PROMPT)
    for _ in range(5):
        y = torch.tensor([tokens[-1]])
        for engine, seq in zip(chain, children):
            y = engine.forward([Step(seq, y, start)])[0]
        tokens.append(int(y.argmax()))
        start += 1
    assert tokens == greedy_cached(chain, PROMPT, 6)[0]
    with pytest.raises(KeyError):
        stores[0].fork("p", "d", len(PROMPT) + 6, len(PROMPT) + 5)  # longer than the parent holds
