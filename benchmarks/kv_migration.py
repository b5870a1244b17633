"""What moving one request's KV cache costs against computing it again (HydraServe §6.2's
migration against λScale §4.4's recomputation), on SmolLM2 split in 4 stages.

Migration (what a draining replica does with QUART_DRAIN=migrate): per stage, the cache is exported,
packed into the wire format with the step, sent through a real redis-server (XADD, then XREADGROUP
as the peer reads its stream), unpacked and adopted. Recomputation (what the entry does when a
cache is lost): a prefill of the whole sequence (prompt plus the tokens generated so far) through
every stage. Both in this process, one thread, at several sequence lengths."""
from __future__ import annotations

import time

import numpy as np
import redis
import torch

from benchmarks.report import SERVING, conditions, scratch, table, write
from contracts.config import load_settings
from contracts.wire import MESSAGE_FIELD, Header, pack, unpack
from models.batched_decoder import BatchedDecoder, Step
from models.kv_cache import KVStore
from models.partition import ensure_partitioned
from models.stage_runner import StageRunner
from runtime.ports import free_port
from runtime.redis_server import start_redis, wait_for_redis
from state import keys

MEASURES = SERVING  # the code measured (benchmarks/freshness.py)

STAGES = 4
LENGTHS = (64, 256, 1024)
REPEATS = 5
STREAM = "bench:migrate"


def main() -> dict:
    torch.set_num_threads(1)
    settings = load_settings()
    manifest = ensure_partitioned(settings.models_dir, "smollm2", STAGES)
    engines = [BatchedDecoder(StageRunner(manifest, i, i + 1).modules) for i in range(STAGES)]
    with scratch("quart-migrate-") as workdir:
        port = free_port()
        proc = start_redis("127.0.0.1", port, workdir, workdir / "redis.log")
        try:
            wait_for_redis("127.0.0.1", port, proc)
            r = redis.Redis(port=port)
            r.xgroup_create(STREAM, keys.GROUP, id="0", mkstream=True)
            rows = [_measure(engines, r, length) for length in LENGTHS]
        finally:
            proc.terminate()
            proc.wait()
    print(table("one request's KV cache: migrated (all 4 stages, one after another) vs recomputed",
                ["positions", "bytes moved", "migrate ms", "recompute ms", "recompute / migrate"],
                [[x["positions"], x["bytes"], x["migrate_ms"], x["recompute_ms"], x["recompute_ms"] / x["migrate_ms"]]
                 for x in rows]))
    figures = []
    for x in rows:
        n = x["positions"]
        figures += [{"name": f"cache bytes at {n} positions (4 stages)", "value": x["bytes"], "unit": "bytes"},
                    {"name": f"migration at {n} positions (4 stages, median)", "value": round(x["migrate_ms"], 3), "unit": "ms"},
                    {"name": f"recomputation at {n} positions (prefill through 4 stages, median)",
                     "value": round(x["recompute_ms"], 3), "unit": "ms"}]
    write("kv_migration", figures, conditions(model="smollm2", stages=STAGES, threads=1, repeats=REPEATS,
                                              dtype="float32", transport="redis-server on loopback, one message per stage"))
    return {"rows": rows}


def _measure(engines: list[BatchedDecoder], r: redis.Redis, length: int) -> dict:
    ids = torch.randint(0, 49152, (length,))
    stores = [KVStore(e.kv_shape(), 1 << 30) for e in engines]
    recompute, migrate, moved = [], [], 0
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        x = ids
        for engine, store in zip(engines, stores):
            x = engine.forward([Step(store.admit("req", length + 1), x, 0)])[0]
        recompute.append((time.perf_counter() - t0) * 1000.0)
        t0 = time.perf_counter()
        moved = sum(_move(r, store) for store in stores)
        migrate.append((time.perf_counter() - t0) * 1000.0)
    return {"positions": length, "bytes": moved, "migrate_ms": float(np.median(migrate)),
            "recompute_ms": float(np.median(recompute))}


def _move(r: redis.Redis, store: KVStore) -> int:
    """One stage's hand-over: export, pack, send, receive, unpack, adopt (into a fresh store)."""
    header = Header(request_id="req.0.1", model="smollm2", stage=0, reply_to="", deadline=time.time() + 60,
                    kind="adopt", seq="req", capacity=store.sequences["req"].capacity)
    message = pack(header, {"input_ids": torch.tensor([[1]]), **store.export("req")})
    r.xadd(STREAM, {MESSAGE_FIELD: message})
    (_, entries), = r.xreadgroup(keys.GROUP, "peer", {STREAM: ">"}, count=1, block=1000)
    msg_id, fields = entries[0]
    got, tensors = unpack(fields[MESSAGE_FIELD])
    r.xack(STREAM, keys.GROUP, msg_id)
    r.xdel(STREAM, msg_id)
    peer = KVStore(store.shape, 1 << 30)
    peer.adopt(got.seq, got.capacity, {k: v for k, v in tensors.items() if k != "input_ids"})
    return len(message)


if __name__ == "__main__":
    main()
