"""A model's entry function: turns a user request into work for stage 0, and waits for the last
stage's answer on this entry replica's reply list. Generation re-runs the sequence through the
pipeline once per new token (there is no KV cache yet), greedily."""
from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid

import redis.asyncio as aioredis
import torch
from transformers import AutoTokenizer

from contracts import keys
from contracts.config import Settings
from contracts.wire import MESSAGE_FIELD, BadRequest, Header, StageTiming, pack, unpack
from pipeline.emulated import WIDTH as EMULATED_WIDTH
from pipeline.emulated import profile as emulation_profile
from pipeline.entry_requests import (
    EMBED_MAX_TOKENS,
    check_prompt_length,
    parse_embed,
    parse_emulated,
    parse_generate,
    parse_json,
)
from pipeline.manifest import Manifest

log = logging.getLogger("quart.entry")


class StageFailed(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Entry:
    def __init__(self, settings: Settings, model: str) -> None:
        self.settings = settings
        self.model = model
        if settings.compute.emulate:
            self.arch = "emulated"
            emulation_profile(settings.compute.emulate)  # an unknown profile fails at start, not per request
        else:
            self.manifest = Manifest.load(settings.model_dir(model))
            self.arch = self.manifest.arch
            self.config = self.manifest.config_object()
            self.tokenizer = AutoTokenizer.from_pretrained(self.manifest.tokenizer_path())
        self.entry_id = f"{self.model}.{settings.server}.{os.getpid()}"
        self.reply_key = keys.reply_list(self.entry_id)
        self.first_stream = keys.stage_stream(self.model, 0)
        self._redis: aioredis.Redis | None = None
        self._pending: dict[str, asyncio.Future] = {}
        self._dispatcher: asyncio.Task | None = None

    async def handle(self, body: bytes) -> tuple[int, dict]:
        """Answers one request: (HTTP status, JSON body)."""
        request_id = uuid.uuid4().hex[:16]
        started = time.time()
        try:
            data = parse_json(body)
            handler = {"llama": self._generate, "bert": self._embed, "emulated": self._emulated}[self.arch]
            answer = await handler(data, request_id, started)
        except BadRequest as exc:
            return exc.status, {"error": str(exc)}
        except StageFailed as exc:
            return exc.status, {"error": str(exc), "id": request_id}
        except TimeoutError:
            return 504, {"error": f"request {request_id} did not finish within "
                                  f"{self.settings.data.request_timeout_s:g} s", "id": request_id}
        answer["id"] = request_id
        answer["latency_ms"] = round((time.time() - started) * 1000.0, 3)
        return 200, answer

    # -- the two kinds of model ----------------------------------------------------------------

    async def _generate(self, data: dict, request_id: str, started: float) -> dict:
        req = parse_generate(data, self.settings.limits.max_new_tokens)
        if req.prompt is not None:
            ids = self.tokenizer(req.prompt)["input_ids"]
        else:
            ids = list(self.tokenizer.apply_chat_template(req.messages, add_generation_prompt=True,
                                                          tokenize=True, return_dict=True)["input_ids"])
        check_prompt_length(len(ids), req.max_new_tokens, self.settings.limits.max_prompt_tokens,
                            self.config.max_position_embeddings)
        deadline = started + self.settings.data.request_timeout_s
        eos = self.config.eos_token_id
        eos = set(eos) if isinstance(eos, list) else {eos}
        new: list[int] = []
        passes: list[list[StageTiming]] = []
        for step in range(req.max_new_tokens):
            header, out = await self._round_trip(f"{request_id}.{step}",
                                                 {"input_ids": torch.tensor([ids + new])}, deadline)
            passes.append(header.timings)
            new.append(int(out["logits"][0].argmax()))
            if new[-1] in eos:
                break
        return {"text": self.tokenizer.decode(new, skip_special_tokens=True), "token_ids": new,
                "passes": len(passes), "stages": _sum_timings(passes)}

    async def _embed(self, data: dict, request_id: str, started: float) -> dict:
        inputs = parse_embed(data, self.settings.limits.max_batch)
        enc = self.tokenizer(inputs, padding=True, truncation=True, max_length=EMBED_MAX_TOKENS,
                             return_tensors="pt")
        header, out = await self._round_trip(f"{request_id}.0", dict(enc),
                                             started + self.settings.data.request_timeout_s)
        return {"embeddings": out["embeddings"].tolist(), "stages": _sum_timings([header.timings])}

    async def _emulated(self, data: dict, request_id: str, started: float) -> dict:
        tokens = parse_emulated(data, self.settings.limits.max_prompt_tokens)
        header, _ = await self._round_trip(f"{request_id}.0", {"hidden": torch.zeros(1, tokens, EMULATED_WIDTH)},
                                           started + self.settings.data.request_timeout_s)
        return {"emulated": True, "tokens": tokens, "stages": _sum_timings([header.timings])}

    # -- talking to the pipeline ---------------------------------------------------------------

    async def _round_trip(self, pass_id: str, tensors: dict[str, torch.Tensor],
                          deadline: float) -> tuple[Header, dict[str, torch.Tensor]]:
        r = await self._connection()
        future = asyncio.get_running_loop().create_future()
        self._pending[pass_id] = future
        header = Header(request_id=pass_id, model=self.model, stage=0, reply_to=self.reply_key,
                        deadline=deadline)
        try:
            await r.xadd(self.first_stream, {MESSAGE_FIELD: pack(header, tensors)})
            header, out = await asyncio.wait_for(future, timeout=max(0.0, deadline - time.time()))
        finally:
            self._pending.pop(pass_id, None)
        if header.error is not None:
            raise StageFailed(header.status, header.error)
        return header, out

    async def _connection(self) -> aioredis.Redis:
        if self._redis is None:
            self._redis = aioredis.Redis.from_url(self.settings.redis.url)
            await self._redis.ping()
            self._dispatcher = asyncio.create_task(self._dispatch())
        return self._redis

    async def _dispatch(self) -> None:
        """One reader of this entry's reply list hands each answer to the request awaiting it."""
        r = aioredis.Redis.from_url(self.settings.redis.url)
        while True:
            try:
                item = await r.blpop([self.reply_key], timeout=1)
            except (aioredis.ConnectionError, OSError) as exc:
                log.warning("reply reader: %s", exc)
                await asyncio.sleep(0.5)
                continue
            if item is None:
                continue
            try:
                header, tensors = unpack(item[1])
            except BadRequest as exc:
                log.error("unreadable reply dropped: %s", exc)
                continue
            future = self._pending.get(header.request_id)
            # No one waiting: the request timed out, or this is a duplicate of reclaimed work.
            if future is not None and not future.done():
                future.set_result((header, tensors))


def _sum_timings(passes: list[list[StageTiming]]) -> list[dict]:
    """Per stage: total queue and service time over all passes, and the replica of the last."""
    by_stage: dict[int, dict] = {}
    for timings in passes:
        for t in timings:
            s = by_stage.setdefault(t.stage, {"stage": t.stage, "queue_ms": 0.0, "service_ms": 0.0})
            s["replica"] = t.replica
            s["queue_ms"] = round(s["queue_ms"] + t.queue_ms, 3)
            s["service_ms"] = round(s["service_ms"] + t.service_ms, 3)
    return [by_stage[k] for k in sorted(by_stage)]
