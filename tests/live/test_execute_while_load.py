"""λScale's execute-while-load and mode switch on the embedded runtime: four virtual servers, each
with its own models folder, behind a model store as slow as their links (QUART_VIRTUAL_DISKS).
SmolLM2's whole-model function serves from vs-0 and vs-1, which hold the model; scaled to four,
its new replicas on vs-2 and vs-3 receive the model from both by one multicast (vs-2 shards 0-1
first, vs-3 shards 2-3 first), and each gets the model's four stage functions beside it as
stand-ins, following the same shards. Requests sent all along are answered with the unsplit
model's tokens, some by stand-ins on vs-2 and vs-3 together (a pipeline across two servers that
each hold part of the model) before either holds the whole model; once a whole replica is ready
the stand-ins on its server drain (the mode switch), and no request is lost."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from benchmarks.execute_while_load import BODY, MODEL, STAGE_FUNCTIONS, WHOLE, WHOLE_STAGES, Senders, keys, prepare, ready, settings_for
from contracts.http_client import GatewayClient
from models.architectures import architecture
from models.sources import bundled_dir
from runtime import __main__ as control
from state.store import RedisStore
from tests.live.runtime_helpers import greedy_reference, wait_until


@pytest.fixture(scope="module")
def runtime(home_settings, partitioned, tmp_path_factory):
    partitioned(MODEL, 4)
    # 651 MB over 12.5 MB/s links: half the model, what a pipeline across the two new servers
    # needs, arrives after about 26 s; the whole after 52 s. The stand-ins have the time between
    # to start and answer (at 25 MB/s, a loaded CI host's stand-ins first answered 3 s after a
    # server held its whole model).
    # Under pytest's basetemp, which keeps the last runs' folders: a failure's logs stay to read.
    home = tmp_path_factory.mktemp("ewl")
    # A stall time well under the 26 s a server waits for its second half: a replica must count
    # the model's whole arrival as progress, not only its own shard's.
    settings = settings_for(home_settings, home, bandwidth=1.25e7).replace(fetch_stall_s=8.0)
    try:
        assert control.up(settings, timeout=900) == 0
        yield settings
    finally:
        control.down(settings)


def test_stand_ins_answer_across_servers_before_the_whole_model_arrives_and_switch_out(runtime):
    settings = runtime
    client, store = GatewayClient.for_settings(settings), RedisStore.from_url(settings.redis_url)
    holders, targets = prepare(settings)
    reference = bundled_dir(MODEL, settings.models_dir / "_sources")
    tokenizer = AutoTokenizer.from_pretrained(reference)
    expected = tokenizer.decode(greedy_reference(architecture("llama").reference(reference),
                                                 tokenizer(BODY["prompt"])["input_ids"], BODY["max_new_tokens"])[0],
                                skip_special_tokens=True)
    with Senders(client, 3).running() as sent:
        before = len(store.placements())
        assert client.scale(WHOLE, 4).status == 202
        wait_until(lambda: ready(client)[WHOLE] == 4, 600, "four whole replicas")
        wait_until(lambda: all(ready(client)[n] == 0 for n in STAGE_FUNCTIONS), 180, "the stand-ins gone")

    placed = store.placements()[before:]
    wholes = [p for p in placed if p.op == "add" and p.stage == WHOLE_STAGES.key]
    scale_up, later = wholes[:len(targets)], wholes[len(targets):]
    assert sorted(p.server for p in scale_up) == targets and {p.path for p in scale_up} == {"peer"}, placed
    # A whole replica placed after the scale-up only replaces one that exited (seen on loaded CI
    # hosts before a shard's reader counted the whole model's arrival as progress, not its own).
    exits = [p for p in placed if p.op == "exit" and p.stage == WHOLE_STAGES.key]
    assert len(later) <= len(exits), (later, exits, placed)
    stand_ins = [p for p in placed if p.op == "add" and "execute-while-load" in p.reason]
    assert sorted((p.server, p.stage) for p in stand_ins) == sorted(
        (s, f"{MODEL}:{i}") for s in targets for i in range(4)), stand_ins
    switched = [p for p in placed if p.op == "remove" and p.reason.startswith("mode switch")]
    gone = [p for p in placed if p.op == "remove" and p.reason.startswith("the whole replica it stood in for is gone")]
    assert sorted((p.server, p.stage) for p in switched + gone) == sorted((p.server, p.stage) for p in stand_ins), placed
    assert len(gone) <= 4 * len(exits) and switched, (gone, exits)

    # Every request answered, with the unsplit model's tokens.
    answers = sent.answers
    assert answers and all(a.status == 200 for a in answers), [a for a in answers if a.status != 200][:3]
    assert {a.text for a in answers} == {expected}
    # Some by stand-ins on both new servers together, before either held the whole model.
    whole_ready = min(p.t for p in placed if p.op == "ready" and p.stage == WHOLE_STAGES.key)
    last_shard = min(max(r["finished"] or 0.0 for r in keys(settings, name).receptions() if r["model"] == MODEL)
                     for name in targets)
    across = [a.at for a in answers if len(a.servers) == 4 and set(a.servers) == set(targets)]
    assert across, [a.servers for a in answers]
    assert min(across) < min(last_shard, whole_ready), (min(across), last_shard, whole_ready)
    assert holders == ["vs-0", "vs-1"]
