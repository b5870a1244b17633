"""Wire format between stages: a small JSON header plus tensors as safetensors bytes.

Never pickle: safetensors holds only raw tensor bytes with a JSON index, so nothing that arrives
from the network can run code when it is read.

A message (`pack`, `unpack`) is framed here rather than by safetensors.torch's save and load.
Both run on every hop, right after a step has streamed the stage's weights through the caches,
where what a call costs is mostly the code and data it touches for the first time since: on a
2-core Xeon with its caches flushed, the library's save took 350 µs and its load (plus a second
parse of the index for the header) 210 µs, this framing with orjson 115 and 125. The bytes are
safetensors all the same (the library reads what `pack` writes, `unpack` what it writes), and
bodies from users (`encode_tensors`, `decode_tensors`) keep the library.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import orjson
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


def step_id(seq: str, start: int) -> str:
    """A generation step's request id: its sequence and the position of its first token (a
    prefill's is 0), which no other step of the sequence shares."""
    return f"{seq}.{start}"


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
    # Set by the entry on a generation's steps: the last stage sends the next decode step to the
    # first stage's holder itself, unless the token sampled is one of `stop_tokens` or the
    # sequence is full, and names that step in its answer's `next_step`.
    chain: bool = False
    stop_tokens: list[int] = field(default_factory=list)
    next_step: str = ""

    @property
    def request(self) -> str:
        """The request (or, of a request of n choices, the choice) this item works for: its id up
        to the first dot (a pass is `<request>.0`, a step `<request>.<recompute>.<step>`)."""
        return self.request_id.split(".", 1)[0]

    def next_decode(self, start: int) -> Header:
        """The decode step at `start` that follows this one, with its route and sampling."""
        return Header(**{**vars(self), "request_id": step_id(self.seq, start), "stage": 0, "enqueued_at": time.time(),
                         "timings": [], "kind": "decode", "start": start, "route": dict(self.route),
                         "sampling": {**self.sampling, "choices": 1}, "next_step": ""})

    def to_json(self) -> bytes:
        # Every field is a JSON value but the timings; asdict's deep copy of them all took half
        # of a hand-off's packing.
        return orjson.dumps({**vars(self), "timings": [vars(t) for t in self.timings]}, option=orjson.OPT_NON_STR_KEYS)

    @classmethod
    def from_json(cls, raw: bytes | str) -> Header:
        data = orjson.loads(raw)
        if not isinstance(data, dict):
            raise TypeError("a header is a JSON object")
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


# safetensors' names of the dtypes a message may carry.
DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
_BY_NAME = {name: dtype for dtype, name in DTYPES.items()}


def pack(header: Header, tensors: dict[str, torch.Tensor]) -> bytes:
    """A message: safetensors bytes whose metadata holds the header."""
    index: dict = {"__metadata__": {HEADER_KEY: header.to_json().decode()}}
    blobs, at = [], 0
    # The widest dtypes first, as the library writes them: every tensor's bytes start aligned.
    for name, t in sorted(tensors.items(), key=lambda item: -item[1].element_size()):
        t = t.detach().contiguous().cpu()
        if t.dtype not in DTYPES:
            raise ValueError(f"tensor {name!r} is {t.dtype}, which a message does not carry")
        size = t.numel() * t.element_size()
        index[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + size]}
        blobs.append(t.view(-1).view(torch.uint8).numpy().tobytes() if size else b"")
        at += size
    head = orjson.dumps(index)
    head += b" " * (-len(head) % 8)   # the format aligns the data to 8 bytes
    return b"".join([len(head).to_bytes(8, "little"), head, *blobs])


def unpack(raw: bytes) -> tuple[Header, dict[str, torch.Tensor]]:
    """A message's header and tensors; BadRequest for anything else (no header, a malformed
    one, bytes that are not safetensors), so a reader of messages never dies of one."""
    index, data = _index(raw)
    metadata = index.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or HEADER_KEY not in metadata:
        raise BadRequest("message has no header: tensors alone are not a pipeline message")
    try:
        header = Header.from_json(metadata[HEADER_KEY])
    except (ValueError, TypeError, KeyError) as exc:
        raise BadRequest(f"message header is malformed: {exc}") from exc
    return header, _tensors(index, data)


def _index(raw: bytes) -> tuple[dict, memoryview]:
    """A safetensors blob's JSON index (an 8-byte length, then the JSON) and its data."""
    size = int.from_bytes(raw[:8], "little")
    if len(raw) < 8 or size > len(raw) - 8:
        raise BadRequest("message is not valid safetensors: it is shorter than its header says")
    try:
        index = orjson.loads(raw[8:8 + size])
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"message is not valid safetensors: {exc}") from exc
    if not isinstance(index, dict):
        raise BadRequest("message is not valid safetensors: its index is not a JSON object")
    return index, memoryview(raw)[8 + size:]


def _tensors(index: dict, data: memoryview) -> dict[str, torch.Tensor]:
    """The tensors an index names, each checked to lie in `data` with the bytes its shape needs;
    copied out of the message (a tensor over the message's immutable bytes must not be written)."""
    owned = bytearray(data)
    tensors, end = {}, 0
    # Names are unique, so the sort never compares two specs.
    for (start, stop), name, spec in sorted((_offsets(name, spec), name, spec) for name, spec in index.items()):
        dtype, shape = _BY_NAME.get(spec.get("dtype")), spec.get("shape")
        if dtype is None or not isinstance(shape, list) or not all(type(n) is int for n in shape):
            raise BadRequest(f"message is not valid safetensors: tensor {name!r} has no known dtype and shape")
        item = dtype.itemsize
        if start != end or stop > len(owned) or min(shape, default=0) < 0 or stop - start != math.prod(shape) * item:
            raise BadRequest(f"message is not valid safetensors: tensor {name!r} does not fit its bytes")
        # A tensor's bytes that start off its dtype's alignment are copied to a buffer of their own.
        buffer, at = (owned, start) if start % item == 0 else (bytearray(owned[start:stop]), 0)
        tensors[name] = (torch.frombuffer(buffer, dtype=dtype, count=(stop - start) // item, offset=at)
                         if stop > start else torch.empty(0, dtype=dtype)).view(shape)
        end = stop
    if end != len(owned):
        raise BadRequest("message is not valid safetensors: bytes left over after its tensors")
    return tensors


def _offsets(name: str, spec: object) -> tuple[int, int]:
    try:
        start, stop = spec["data_offsets"]
        if isinstance(start, int) and isinstance(stop, int) and 0 <= start <= stop:
            return start, stop
    except (KeyError, TypeError, ValueError):
        pass
    raise BadRequest(f"message is not valid safetensors: tensor {name!r} has no valid data offsets")


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
