"""Joins of a DAG pipeline (contracts/stage_graph.py): each predecessor of a join stage leaves
its part of a request in a Redis hash, and the one that brings the last part queues the request
at the join's stream in the same script. So a request reaches the join once and whole, whichever
replicas ran its branches, and the join's queue holds whole requests, as a chain's does. The
join's replica reads the parts when it takes the request and deletes them in the transaction that
hands the request on (a replica that dies meanwhile leaves them to the one that reclaims it)."""
from __future__ import annotations

import redis
import torch

from contracts.wire import MESSAGE_FIELD, BadRequest, Header, pack, unpack
from state import keys

# KEYS: the parts hash, the join stage's stream. ARGV: this part's predecessor, its message, the
# parts the join needs, the hash's time to live (ms), the message to queue, the stream's field.
# HSETNX: a part delivered twice counts once.
_PART = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 and redis.call('HLEN', KEYS[1]) == tonumber(ARGV[3]) then
  redis.call('XADD', KEYS[2], '*', ARGV[6], ARGV[5])
end
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return 0
"""


class Joins:
    def __init__(self, r: redis.Redis, model: str, ttl_ms: int) -> None:
        self.r, self.model, self.ttl_ms = r, model, ttl_ms
        self._part = r.register_script(_PART)

    def send_part(self, pipe: redis.client.Pipeline, header: Header, tensors: dict[str, torch.Tensor],
                  source: int, parts: int) -> None:
        """Leaves the part from stage `source` of the request for the join stage `header.stage`
        (in `pipe`'s transaction), which needs `parts` of them."""
        stage = header.stage
        self._part(keys=[keys.join_parts(self.model, stage, header.request_id), keys.stage_stream(self.model, stage)],
                   args=[source, pack(header, tensors), parts, self.ttl_ms, pack(header, {}), MESSAGE_FIELD],
                   client=pipe)

    def collect(self, header: Header, sources: list[int]) -> tuple[Header, dict[int, dict[str, torch.Tensor]]]:
        """The request's parts by predecessor, and its header with every branch's stage timings
        (each stage once); BadRequest (504) if they expired before the join took the request."""
        raw = self.r.hgetall(keys.join_parts(self.model, header.stage, header.request_id))
        parts = {int(k): unpack(v) for k, v in raw.items()}
        if sorted(parts) != sources:
            raise BadRequest(f"the parts of this request from stages {sources} expired before the join ran "
                             f"(found {sorted(parts)})", status=504)
        seen = {t.stage for t in header.timings}
        for part_header, _ in parts.values():
            for t in part_header.timings:
                if t.stage not in seen:
                    seen.add(t.stage)
                    header.timings.append(t)
        header.timings.sort(key=lambda t: t.stage)
        return header, {source: tensors for source, (_, tensors) in parts.items()}

    def done(self, pipe: redis.client.Pipeline, header: Header, stage: int) -> None:
        pipe.delete(keys.join_parts(self.model, stage, header.request_id))
