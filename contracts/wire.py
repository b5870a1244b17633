"""Wire format between stages: a small JSON header plus tensors as safetensors bytes.

Never pickle: safetensors holds only raw tensor bytes with a JSON index, so nothing that arrives
from the network can run code when it is read.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from contracts.config import Limits
from contracts.requests import BadRequest as BadRequest  # re-exported: the wire's error

# A message is one safetensors blob whose metadata carries the JSON header under this key.
HEADER_KEY = "quart.header"
# Field of a stream entry that holds the message.
MESSAGE_FIELD = b"m"
CONTENT_TYPE = "application/octet-stream"


@dataclass
class StageTiming:
    stage: int
    replica: str
    queue_ms: float
    service_ms: float


# What a message asks of a stage. "pass": run the stages on the tensors as they are (embeddings,
# emulated models, a single forward). A generative request's steps: "prefill" starts a sequence's
# KV cache on whichever replica takes it from the shared stream; "decode" extends it on the
# replica that holds it (the route); "free" drops it; "adopt" is a decode step that carries the
# sequence's cache to another replica of the stage (a draining replica migrates it). A stage
# answers "lost" when the cache a step needs is gone (its replica died or expired it): the entry
# then prefills again. "install" hands a replica of a wider stage range the cache that the
# narrower holders gathered on a decode step's way through them (pipeline consolidation). "fork"
# copies the prompt's cache of one sequence into another at every holder (a request's choices
# share one prefill).
KINDS = ("pass", "prefill", "decode", "free", "adopt", "install", "fork", "lost")


@dataclass
class Header:
    request_id: str
    model: str
    stage: int
    reply_to: str
    deadline: float
    enqueued_at: float = field(default_factory=time.time)
    timings: list[StageTiming] = field(default_factory=list)
    # Set by a stage that could not process the request; the entry answers with it.
    error: str | None = None
    status: int = 200
    kind: str = "pass"
    seq: str = ""                 # the KV sequence a prefill, decode or free is about
    start: int = 0                # position of the step's first token
    capacity: int = 0             # positions a prefill reserves (prompt plus new tokens)
    # Stage (its first index, as a string) -> the replica holding this sequence's cache there.
    route: dict[str, str] = field(default_factory=dict)
    sampling: dict = field(default_factory=dict)
    retry_after: float = 0.0      # with status 429: when room is likely
    # The replica of a wider stage range that this decode step's holders hand their caches to
    # (each runs the step, then sends its cache on with it): set by a draining holder.
    gather: str = ""
    # A fork's source: the sequence whose first `start` positions (the shared prompt) it copies.
    parent: str = ""

    @property
    def request(self) -> str:
        """The request (or, of a request of n choices, the choice) this item works for: its id up
        to the first dot (a pass is `<request>.0`, a step `<request>.<recompute>.<step>`)."""
        return self.request_id.split(".", 1)[0]

    def to_json(self) -> bytes:
        # Every field is a JSON value but the timings; asdict's deep copy of them all took half
        # of a hand-off's packing.
        fields = {**vars(self), "timings": [vars(t) for t in self.timings]}
        return json.dumps(fields, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Header:
        data = json.loads(raw)
        data["timings"] = [StageTiming(**t) for t in data.get("timings", [])]
        header = cls(**data)
        if header.kind not in KINDS:
            raise ValueError(f"unknown message kind {header.kind!r}")
        return header


def encode_tensors(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    return st_save({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, metadata=metadata)


def decode_tensors(raw: bytes) -> dict[str, torch.Tensor]:
    try:
        return st_load(raw)
    except Exception as exc:  # safetensors raises its own error types for any malformed byte
        raise BadRequest(f"body is not valid safetensors: {exc}") from exc


def pack(header: Header, tensors: dict[str, torch.Tensor]) -> bytes:
    return encode_tensors(tensors, metadata={HEADER_KEY: header.to_json().decode()})


def unpack(raw: bytes) -> tuple[Header, dict[str, torch.Tensor]]:
    """A message's header and tensors; BadRequest for anything else (no header, a malformed
    one, bytes that are not safetensors), so a reader of messages never dies of one."""
    metadata = read_metadata(raw)
    if HEADER_KEY not in metadata:
        raise BadRequest("message has no header: tensors alone are not a pipeline message")
    try:
        header = Header.from_json(metadata[HEADER_KEY])
    except (ValueError, TypeError, KeyError) as exc:
        raise BadRequest(f"message header is malformed: {exc}") from exc
    return header, decode_tensors(raw)


def read_metadata(raw: bytes) -> dict[str, str]:
    """The metadata of a safetensors blob: an 8-byte length, then a JSON index."""
    try:
        size = int.from_bytes(raw[:8], "little")
        index = json.loads(raw[8:8 + size])
        return index.get("__metadata__") or {}
    except (ValueError, AttributeError) as exc:
        raise BadRequest(f"message is not valid safetensors: {exc}") from exc


def check_size(t: torch.Tensor, limits: Limits, max_batch: int, max_length: int | None = None) -> None:
    """A pass's cost is bounded: its batch, each sequence's length, and batch × length."""
    batch, length = t.shape[0], t.shape[1]
    if not 1 <= batch <= max_batch:
        raise BadRequest(f"batch of {batch}; allowed 1..{max_batch}", status=413 if batch else 400)
    longest = min(limits.max_context, max_length or limits.max_context)
    if not 1 <= length <= longest:
        raise BadRequest(f"sequences of {length} tokens; allowed 1..{longest}", status=413 if length else 400)
    if batch * length > limits.max_pass_tokens:
        raise BadRequest(f"{batch} × {length} tokens in one pass; at most {limits.max_pass_tokens}", status=413)
