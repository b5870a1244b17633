"""The bursts benchmark's count of refusals that were likely wrong: a request refused with
objectives that the same trace without them answered within the objective."""
from __future__ import annotations

from benchmarks.bursts import OBJECTIVE_S, refused_yet_met
from loadgen.client import Record


def _record(index: int, status: int, latency_s: float = -1.0) -> Record:
    return Record(index, "smollm2", float(index), sent=float(index), latency_s=latency_s, status=status)


def test_only_a_refusal_answered_in_time_without_objectives_counts():
    guarded = [_record(0, 429), _record(1, 429), _record(2, 429), _record(3, 200, 1.0), _record(4, 429)]
    plain = [_record(0, 200, OBJECTIVE_S - 0.5),   # refused, yet met without: counts
             _record(1, 200, OBJECTIVE_S + 0.5),   # refused, and late without: a refusal that may be right
             _record(2, 504),                      # refused, and not answered without
             _record(3, 200, 1.0),                 # answered both ways
             _record(4, 200, OBJECTIVE_S)]         # within the objective, on its edge: counts
    assert refused_yet_met(guarded, plain) == 2
