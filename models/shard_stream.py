"""The tensors of a safetensors shard as its bytes arrive (HydraServe §5.2's parameter manager,
on the CPU): the header comes first and names every tensor's byte range, so each tensor is made
(zero-copy, over the reader's buffer) as soon as its range has arrived, in file order."""
from __future__ import annotations

import json
import struct
from collections.abc import Iterator

import torch

from models.fetch import FetchError
from models.shard_reader import ShardReader

# safetensors' dtype names
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
HEADER_LIMIT = 100 << 20


def stream_tensors(reader: ShardReader, whole_first: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) in the order the shard holds them, each once its bytes are there;
    `whole_first`: only once the whole shard is read and checked. The last one comes only after
    the shard's sha256 matched: a consumer that reaches the end holds good parameters."""
    if whole_first:
        reader.wait_done()
    reader.wait_for(8)
    (length,) = struct.unpack("<Q", reader.buffer[:8])
    if length > HEADER_LIMIT:
        raise FetchError(f"shard {reader.info.shard}: a header of {length} bytes is not safetensors")
    reader.wait_for(8 + length)
    header = json.loads(bytes(reader.buffer[8:8 + length]))
    header.pop("__metadata__", None)
    entries = sorted(header.items(), key=lambda item: item[1]["data_offsets"][0])
    base = 8 + length
    for i, (name, spec) in enumerate(entries):
        start, end = spec["data_offsets"]
        if i == len(entries) - 1:
            reader.wait_done()
        else:
            reader.wait_for(base + end)
        yield name, _tensor(reader.buffer, spec, base + start, end - start)
    if not entries:
        reader.wait_done()


def _tensor(buffer: bytearray, spec: dict, offset: int, size: int) -> torch.Tensor:
    dtype, shape = DTYPES[spec["dtype"]], spec["shape"]
    if size == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype, count=size // dtype.itemsize, offset=offset).view(shape)
