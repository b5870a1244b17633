"""Where a stage range's output goes, by the model's stage graph (contracts/stage_graph.py): on to
every successor (a join's part where the successor joins several, engine/join.py), or the reply
where there is none or the request failed. One path for single passes and for generation steps
(a generative model's graph is a chain: its one successor)."""
from __future__ import annotations

import time

import torch

from contracts.stage_graph import Edges, check_range, predecessors, successors
from contracts.wire import Header
from engine.transport import Commit


class Routes:
    def __init__(self, graph: Edges, first: int, last: int) -> None:
        check_range(graph, first, last)
        self.last = last
        self.next_stages = successors(graph, last - 1)
        # At a join (a stage with several predecessors), the stages whose parts a request brings here.
        before = predecessors(graph, first)
        self.join_of = before if len(before) > 1 else []
        self.next_parts = {s: len(predecessors(graph, s)) for s in self.next_stages}

    def forward(self, commit: Commit, header: Header, tensors: dict[str, torch.Tensor]) -> None:
        if header.error is not None or not self.next_stages:
            commit.reply(header, tensors)
            return
        header.enqueued_at = time.time()
        for stage, parts in self.next_parts.items():
            header.stage = stage
            if parts > 1:
                commit.part(header, tensors, self.last - 1, parts)
            else:
                commit.to_stage(stage, header, tensors)
