"""A DAG pipeline on the embedded runtime: the emulated ensemble-8, whose stage 0 fans out to
three branches that stage 7 joins. Every request is answered once; each stage, the join included,
runs it once, whichever replicas ran its branches; the join leaves no parts behind; and the
autoscaler sees the model as the graph it is."""
from __future__ import annotations

import json
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from state import keys
from state.store import RedisStore
from tests.live.test_autoscaler_live import emulated_settings

MODEL = "ensemble-8"
REQUESTS = 30


@pytest.fixture(scope="module")
def dag(home_settings, tmp_path_factory):
    from runtime import __main__ as control
    settings = emulated_settings(home_settings, tmp_path_factory.mktemp("dag"), model=MODEL)
    try:
        assert control.up(settings, timeout=600) == 0
        yield settings, redis.Redis.from_url(settings.redis_url)
    finally:
        control.down(settings)


def ask(url: str) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps({"tokens": 8}).encode(), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {}


def test_every_stage_and_the_join_run_each_request_once(dag):
    settings, r = dag
    # Concurrent requests, so that the branches of one request and the parts at the join
    # interleave with those of others.
    with ThreadPoolExecutor(10) as pool:
        answers = list(pool.map(lambda _: ask(f"{settings.gateway.url}/function/{MODEL}"), range(REQUESTS)))
    assert [status for status, _ in answers] == [200] * REQUESTS
    assert all([s["stage"] for s in body["stages"]] == list(range(8)) for _, body in answers)
    for stage in range(8):
        ran = Counter(x.request_id for x in RedisStore(r).samples(MODEL, stage))
        assert len(ran) == REQUESTS and set(ran.values()) == {1}, (stage, ran)
    assert r.keys(keys.join_parts(MODEL, 7, "*")) == []


def test_the_autoscaler_splits_the_slo_along_the_graphs_paths(dag):
    """Each stage's delay target is its share of the SLO along the heaviest path through it: the
    targets of the stages of that path (0, 1, 4, 7: the large model's branch) add up to the SLO,
    where on a chain of 8 all eight would."""
    settings, r = dag
    entries = RedisStore(r).decisions(MODEL, count=1)
    assert entries, "no decision for the DAG model"
    targets = [s["target_s"] for s in entries[0].stages]
    assert sum(targets[i] for i in (0, 1, 4, 7)) == pytest.approx(settings.autoscaler.slo_s, rel=1e-3)
    assert sum(targets) > 1.5 * settings.autoscaler.slo_s
