"""A model's stage graph: edges (from, to) between stage indices. A chain 0 -> 1 -> ... is the
default; a DAG (a fan-out/fan-in pipeline, QUART §4.1) has stage 0 as its only source and its
last stage as its only sink. A stage with several predecessors (a join) runs a request once the
parts of all of them are in. Replicas route by it, the autoscaler and the simulator size by it."""
from __future__ import annotations

from functools import cache

Edges = tuple[tuple[int, int], ...]


@cache  # the autoscaler asks for every chain's edges on every tick
def chain(num_stages: int) -> Edges:
    """The edges of a chain 0 -> 1 -> ... -> num_stages - 1."""
    return tuple((i, i + 1) for i in range(num_stages - 1))


def successors(edges: Edges, stage: int) -> list[int]:
    return sorted(b for a, b in edges if a == stage)


def predecessors(edges: Edges, stage: int) -> list[int]:
    return sorted(a for a, b in edges if b == stage)


def check_range(edges: Edges, first: int, last: int) -> None:
    """A stage function serves a run of stages [first, last): it must be a path of the graph that
    nothing enters or leaves midway (else a request would skip the stages in it, or a join could
    not collect its parts). ValueError otherwise."""
    for stage in range(first, last - 1):
        if successors(edges, stage) != [stage + 1] or predecessors(edges, stage + 1) != [stage]:
            raise ValueError(f"stages [{first}, {last}) are not a path of the stage graph: "
                             f"{stage} -> {successors(edges, stage)}, {predecessors(edges, stage + 1)} -> {stage + 1}")
