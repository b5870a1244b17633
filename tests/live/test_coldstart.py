"""Cold starts HydraServe's way, with real processes, a real KeysManager as the model store and
another as a server's prefetcher, real HTTP and real weights: streamed and prefetched shards give
the parameters the files hold, a shard that fails its checksum aborts its cold start with a clear
error, a cancelled prefetch frees what it wrote, and pipelines of 1, 2 and 4 cold workers answer
with the same tokens."""
from __future__ import annotations

import asyncio
import hashlib
import shutil
import subprocess
import sys
import threading
import time

import pytest
from safetensors.torch import load_file

from contracts.config import child_environment
from contracts.paths import REPO_ROOT, STAGE_HANDLER
from contracts.stage import StageRef
from frontend.pipeline_client import PipelineClient, Progress, StageFailed
from keysmanager.client import KeysClient, KeysManagerError
from keysmanager.pacing import Link
from keysmanager.prefetch import Prefetcher
from models.fetch import FetchError
from models.manifest import Manifest
from models.sampling import Sampling
from models.shard_reader import PART, ShardReader, _follow, record_prefetch_error, start_readers
from models.shard_stream import stream_tensors
from runtime.functions import start_watchdog
from runtime.ports import free_port
from scheduler.coldstart import stage_ranges
from state import keys
from tests.live.runtime_helpers import reference_greedy, wait_until


def digests(tensors) -> dict[str, str]:
    return {name: hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest() for name, t in tensors}


def file_digests(manifest: Manifest, stage: int) -> dict[str, str]:
    return digests(load_file(str(manifest.shard_path(stage))).items())


@pytest.fixture(scope="module")
def store(km):
    """The km fixture's KeysManager serves the test models: the model store's URL."""
    settings = km[0]
    return settings, f"http://127.0.0.1:{settings.cache.port}"


@pytest.fixture(scope="module")
def prefetcher(store, tmp_path_factory):
    """A second KeysManager standing for another server, fetching from the store."""
    settings, url = store
    home = tmp_path_factory.mktemp("prefetcher")
    mine = settings.replace(home=str(home), models=str(home / "models"), models_url=url, server="pf-test",
                            keysmanager_port=free_port(), cache_stages="none", internal_token=settings.internal_api_token())
    (home / "logs").mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "keysmanager"], env=child_environment(mine), cwd=REPO_ROOT,
                            stdout=open(home / "logs" / "keysmanager.log", "ab"), stderr=subprocess.STDOUT)
    client = KeysClient.for_settings(mine, timeout=120)
    try:
        wait_until(client.healthy, 120, "the prefetcher's KeysManager")
        yield mine, client
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_streamed_tensors_are_the_files_tensors(km):
    settings = km[0]
    manifest = Manifest.load(settings.model_dir("smollm2"))
    readers = start_readers(settings, StageRef("smollm2", 0, 4))
    for i, reader in readers.items():
        assert reader.where == str(manifest.shard_path(i))  # read from this server's disk
        assert digests(stream_tensors(reader)) == file_digests(manifest, i)
    whole = start_readers(settings, StageRef("smollm2", 2, 3))[2]
    assert digests(stream_tensors(whole, whole_first=True)) == file_digests(manifest, 2)


def test_a_shard_fetched_from_the_store_streams_and_is_kept_on_disk(store, tmp_path):
    settings, url = store
    here = settings.replace(models=str(tmp_path / "models"), models_url=url)
    readers = start_readers(here, StageRef("smollm2", 1, 3))
    source = Manifest.load(settings.model_dir("smollm2"))
    for i, reader in readers.items():
        assert reader.where.startswith(url)
        assert digests(stream_tensors(reader)) == file_digests(source, i)
    kept = Manifest.load(tmp_path / "models" / "smollm2")
    assert sorted(p.name for p in kept.directory.glob("*.safetensors*")) == \
        sorted(source.stages[i].shard for i in (1, 2))


def test_a_shard_that_fails_its_checksum_mid_stream_aborts_the_cold_start(store, tmp_path):
    settings, url = store
    tampered = settings.model_dir("smollm2-tampered")
    shutil.copytree(settings.model_dir("smollm2"), tampered)
    try:
        with open(tampered / Manifest.load(tampered).stages[0].shard, "r+b") as f:
            f.seek(-4, 2)
            f.write(b"\0\0\0\1")
        here = settings.replace(models=str(tmp_path / "models"), models_url=url)
        reader = start_readers(here, StageRef("smollm2-tampered", 0, 1))[0]
        with pytest.raises(FetchError, match="sha256"):
            list(stream_tensors(reader))
        assert not list((tmp_path / "models").rglob("*.safetensors*"))  # neither the shard nor its .part
        # A cold replica of it exits with that reason instead of serving, and a request waiting on
        # the stage is answered 503 with it (not left to time out).
        log = tmp_path / "replica.log"
        proc = start_watchdog(here, STAGE_HANDLER, {"QUART_MODEL": "smollm2-tampered", "QUART_STAGES": "0"}, None, log)
        assert proc.wait(timeout=180) != 0
        assert "sha256" in log.read_text()
        client = PipelineClient(here.replace(reclaim_idle_ms=500), "smollm2-tampered", "tampered-test")
        with pytest.raises(StageFailed) as failed:
            asyncio.run(_collect(client.generate("t", [1, 2, 3], 2, Sampling(), time.time() + 60, Progress())))
        assert failed.value.status == 503 and "stage 0 of smollm2-tampered cannot start" in str(failed.value)
        assert "sha256" in str(failed.value)
    finally:
        shutil.rmtree(tampered)


def test_a_reader_follows_a_shard_being_written_and_fails_on_its_error_file(km, tmp_path):
    manifest = Manifest.load(km[0].model_dir("smollm2"))
    info = manifest.stages[1]
    data = manifest.shard_path(1).read_bytes()
    target = tmp_path / info.shard
    part = target.with_name(target.name + PART)

    def write(fail: bool) -> None:
        with open(part, "wb") as out:
            for i in range(0, len(data), 1 << 20):
                if fail and i > len(data) // 2:
                    part.unlink()
                    record_prefetch_error(target, "sha256 mismatch in the store")
                    return
                out.write(data[i:i + (1 << 20)])
                out.flush()
                time.sleep(0.005)
        part.rename(target)

    part.write_bytes(b"")
    writer = threading.Thread(target=write, args=(False,))
    writer.start()
    reader = ShardReader(info, "test", lambda view: _follow(target, view, 30.0), verify=False).start()
    assert digests(stream_tensors(reader)) == file_digests(manifest, 1)
    writer.join()
    target.unlink()
    part.write_bytes(b"")
    writer = threading.Thread(target=write, args=(True,))
    writer.start()
    reader = ShardReader(info, "test", lambda view: _follow(target, view, 30.0), verify=False).start()
    with pytest.raises(FetchError, match="sha256 mismatch in the store"):
        list(stream_tensors(reader))
    writer.join()


def test_prefetched_shards_stream_the_same_parameters_and_a_cancel_frees_them(store, prefetcher, tmp_path):
    settings, _ = store
    mine, client = prefetcher
    stage = StageRef("smollm2", 1, 3)
    assert client.prefetch(stage)["state"] in ("fetching", "done")
    wait_until(lambda: all(p["state"] == "done" for p in client.prefetches()), 120, "the prefetch")
    # A replica on that server with no model on its disk and no store reads the prefetched copy.
    replica = mine.replace(models=str(tmp_path / "models"))
    shutil.copytree(mine.model_dir("smollm2"), tmp_path / "models" / "smollm2",
                    ignore=shutil.ignore_patterns("*.safetensors"))
    readers = start_readers(replica.replace(models_url=""), stage)
    source = Manifest.load(settings.model_dir("smollm2"))
    for i, reader in readers.items():
        assert reader.where.startswith("prefetch")
        assert digests(stream_tensors(reader)) == file_digests(source, i)
    folder = mine.prefetch_dir(mine.server) / "smollm2"
    assert sorted(p.name for p in folder.iterdir()) == sorted(source.stages[i].shard for i in (1, 2))
    assert client.cancel_prefetch("smollm2")["cancelled"]
    assert not folder.exists() and client.prefetches() == []


class CountingLink(Link):
    """A real paced link that counts the bytes read through it."""

    def __init__(self, bytes_per_s: float) -> None:
        super().__init__(bytes_per_s)
        self.taken = 0
        self._count = threading.Lock()

    def take(self, size: int) -> None:
        with self._count:
            self.taken += size
        super().take(size)


def test_prefetches_of_overlapping_ranges_fetch_a_shard_once(store, tmp_path):
    """Two prefetches that begin on the same shard at once (ranges 1-2 and 1-3): both finish,
    and each shard crosses the link once, checked whole."""
    settings, url = store
    mine = settings.replace(home=str(tmp_path), models=str(tmp_path / "models"), models_url=url, server="pf-twice",
                            internal_token=settings.internal_api_token())
    link = CountingLink(2e8)  # slow enough that the second starts while the first still reads shard 1
    prefetcher = Prefetcher(mine, link)
    prefetcher.start(StageRef("smollm2", 1, 2))
    prefetcher.start(StageRef("smollm2", 1, 3))
    wait_until(lambda: all(p["state"] != "fetching" for p in prefetcher.list()), 120, "both prefetches")
    assert [p["state"] for p in prefetcher.list()] == ["done", "done"], prefetcher.list()
    source = Manifest.load(settings.model_dir("smollm2"))
    once = sum(source.stages[i].bytes for i in (1, 2))
    assert once <= link.taken < once + source.stages[1].bytes  # a chunk a read asked for at most over
    folder = mine.prefetch_dir(mine.server) / "smollm2"
    for i in (1, 2):
        assert digests(load_file(str(folder / source.stages[i].shard)).items()) == file_digests(source, i)
    prefetcher.shutdown()


def test_bad_prefetch_requests_get_a_4xx(km, prefetcher):
    _, client = prefetcher
    for stage, status in ((StageRef("no-such-model", 0, 1), 404), (StageRef("smollm2", 3, 9), 400)):
        with pytest.raises(KeysManagerError) as err:
            client.prefetch(stage)
        assert err.value.status == status
    with pytest.raises(KeysManagerError) as err:  # a server whose models lie on its own disk
        km[1].prefetch(StageRef("smollm2", 0, 1))
    assert err.value.status == 409


@pytest.mark.parametrize("size", [1, 2, 4])
def test_cold_pipelines_of_1_2_and_4_workers_answer_the_same_tokens(store, sources, tokenizer, tmp_path, size):
    settings, url = store
    here = settings.replace(models=str(tmp_path / "models"), models_url=url, threads=1)
    r = __import__("redis").Redis.from_url(here.redis_url)
    for a, _ in stage_ranges(4, 4):
        r.delete(keys.stage_stream("smollm2", a))
    procs = [start_watchdog(here, STAGE_HANDLER, {"QUART_MODEL": "smollm2", "QUART_STAGES": StageRef("smollm2", a, b).stages},
                            None, tmp_path / f"replica-{a}.log") for a, b in stage_ranges(4, size)]
    prompt = tokenizer("The capital of France is")["input_ids"]
    try:
        tokens = asyncio.run(_generate(here, prompt, 6))
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert tokens == reference_greedy(sources, prompt, 6)


async def _collect(tokens) -> list[int]:
    return [t async for t in tokens]


async def _generate(settings, prompt: list[int], n: int) -> list[int]:
    client = PipelineClient(settings, "smollm2", f"coldstart-test-{time.time_ns()}")
    try:
        return [t async for t in client.generate("cs", prompt, n, Sampling(), time.time() + 300, Progress())]
    finally:
        await client.aclose()
