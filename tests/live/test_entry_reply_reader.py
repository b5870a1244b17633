"""The entry's reply reader against a real redis-server: a message it cannot read (a blob with
no header, garbage) is dropped with a log line, and the reader goes on delivering answers."""
from __future__ import annotations

import asyncio

import redis
import torch

from contracts.config import load_settings
from contracts.wire import Header, encode_tensors, pack
from frontend.entry import Entry


def test_the_reply_reader_survives_unreadable_replies(tmp_path, redis_port):
    settings = load_settings(environ={}, home=str(tmp_path), redis_port=redis_port, emulate="llama-7b")
    client = Entry(settings, "llama-7b").client
    r = redis.Redis(port=redis_port)

    async def scenario() -> Header:
        await client._connection()      # starts the reader
        future = asyncio.get_running_loop().create_future()
        client._pending["req-1"] = future
        r.rpush(client.reply_key, encode_tensors({"x": torch.ones(1)}), b"\x00garbage")
        await asyncio.sleep(0.5)
        header = Header(request_id="req-1", model="llama-7b", stage=7, reply_to=client.reply_key, deadline=0)
        r.rpush(client.reply_key, pack(header, {"logits": torch.ones(1, 4)}))
        got, tensors = await asyncio.wait_for(future, timeout=10)
        assert not client._dispatcher.done() and tensors["logits"].shape == (1, 4)
        return got

    assert asyncio.run(scenario()).request_id == "req-1"
