"""One hop between stages: serialise, XADD, XREADGROUP in another process, deserialise.

Timed from before serialisation in the producer to after deserialisation in the consumer, one
message in flight at a time, against a real redis-server on loopback."""
from __future__ import annotations

import multiprocessing as mp
import tempfile
import time
from pathlib import Path

import redis
import torch

from benchmarks.report import SERVING, conditions, percentiles, table, write
from contracts.wire import MESSAGE_FIELD, Header, pack, unpack
from runtime.ports import free_port
from runtime.redis_server import start_redis
from state import keys

MEASURES = SERVING  # the code measured (benchmarks/freshness.py)

CASES = [("128x576 float32", (128, 576), torch.float32), ("1024x4096 bfloat16", (1024, 4096), torch.bfloat16)]
STREAM, DONE = "bench:hop", "bench:hop:done"


def _consumer(port: int, count: int) -> None:
    r = redis.Redis(port=port)
    for _ in range(count):
        (_, entries), = r.xreadgroup(keys.GROUP, "c", {STREAM: ">"}, count=1, block=0)
        msg_id, fields = entries[0]
        header, tensors = unpack(fields[MESSAGE_FIELD])
        elapsed = (time.time() - header.enqueued_at) * 1000.0
        r.pipeline().xack(STREAM, keys.GROUP, msg_id).xdel(STREAM, msg_id).lpush(DONE, f"{elapsed:.6f}").execute()


def measure(port: int, shape: tuple[int, int], dtype: torch.dtype, count: int, warmup: int) -> list[float]:
    r = redis.Redis(port=port)
    r.delete(STREAM, DONE)
    r.xgroup_create(STREAM, keys.GROUP, id="0", mkstream=True)
    worker = mp.get_context("spawn").Process(target=_consumer, args=(port, count + warmup))
    worker.start()
    tensor = torch.randn(shape).to(dtype)
    samples = []
    for i in range(count + warmup):
        header = Header(request_id=str(i), model="bench", stage=1, reply_to="-", deadline=time.time() + 60,
                        enqueued_at=time.time())
        r.xadd(STREAM, {MESSAGE_FIELD: pack(header, {"hidden": tensor})})
        _, elapsed = r.blpop([DONE], timeout=30)
        if i >= warmup:
            samples.append(float(elapsed))
    worker.join()
    r.delete(STREAM)
    return samples


def main(count: int = 500, warmup: int = 20) -> dict:
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        server = start_redis("127.0.0.1", port, Path(tmp), Path(tmp) / "redis.log")
        try:
            results = {name: percentiles(measure(port, shape, dtype, count, warmup)) for name, shape, dtype in CASES}
        finally:
            server.terminate()
            server.wait()
    rows = [[name, f"{shape[0] * shape[1] * dtype.itemsize / 1e6:.2f} MB", results[name]["p50"], results[name]["p99"]]
            for name, shape, dtype in CASES]
    print(table("One hop: serialise + XADD + XREADGROUP + deserialise (ms, loopback)",
                ["activation", "size", "p50 ms", "p99 ms"], rows))
    figures = []
    for name, _, _ in CASES:
        for stat in ("p50", "p99", "mean"):
            figures.append({"name": f"hop {name} {stat}", "value": results[name][stat], "unit": "ms"})
    p50 = results[CASES[0][0]]["p50"]
    print(f"target p50 <= 2 ms for 128x576 float32: {'met' if p50 <= 2.0 else 'missed'} ({p50:.3f} ms)")
    write("hop", figures, conditions(samples_per_case=count, warmup=warmup, transport="redis-server on loopback",
                                     in_flight=1))
    return results


if __name__ == "__main__":
    main()
