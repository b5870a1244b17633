"""The gateway's wake from zero (runtime/activator.py) with a layout chooser: which functions a
sleeping model wakes as, and what it records. A real MemoryStore; the chooser is Algorithm 1's
(scheduler/wake_layout.py) over servers given by hand."""
from __future__ import annotations

from pathlib import Path

from runtime.activator import Activator
from runtime.functions import FunctionState
from scheduler.coldstart import ColdServer, ColdStartCosts
from scheduler.wake_layout import choose
from state.memory import MemoryStore
from state.records import PIPELINED, WHOLE

ZERO = {"com.openfaas.scale.zero": "true", "com.openfaas.scale.zero-duration": "1m"}
COSTS = ColdStartCosts(create_s=0.0, libraries_s=2.0, prefill_s=0.2, decode_s=0.05, hop_s=0.0)


def function(name: str, stages: str = "", labels: dict | None = None, desired: int = 0) -> FunctionState:
    env = {"QUART_MODEL": "m"} | ({"QUART_STAGES": stages} if stages else {})
    return FunctionState({"service": name, "envVars": env, "labels": labels or {}}, Path("handler"), desired)


def model(whole_desired: int = 0, sleeping: int = 4) -> list[FunctionState]:
    """Entry, whole function, four stage functions labelled to sleep (the first `sleeping` at zero)."""
    return [function("m", desired=1), function("m-whole", "0-4", {"com.quart.whole": "true", **ZERO}, whole_desired),
            *(function(f"m-s{i}", str(i), ZERO, 0 if i < sleeping else 1) for i in range(4))]


def activator(store: MemoryStore, objective: float) -> Activator:
    servers = [ColdServer(f"s{i}", 0.5e9, float("inf")) for i in range(4)]
    return Activator(store, lambda fn: 1, 30.0, lambda m, fns: choose(COSTS, 2e9, servers, 4, objective))


def desired(functions: list[FunctionState]) -> dict[str, int]:
    return {fn.name: fn.desired for fn in functions}


def test_a_sleeping_model_wakes_whole_where_the_whole_model_meets_its_objective():
    store, functions = MemoryStore(), model()
    assert activator(store, 5.0).wake(functions, functions[0], now=10.0)
    assert desired(functions) == {"m": 1, "m-whole": 1, "m-s0": 0, "m-s1": 0, "m-s2": 0, "m-s3": 0}
    assert store.layout("m") == WHOLE and store.layout_changes("m")[-1].reason.startswith("woken whole")


def test_it_wakes_as_its_stage_functions_where_only_they_meet_it():
    store, functions = MemoryStore(), model()
    assert activator(store, 3.0).wake(functions, functions[0], now=10.0)
    assert desired(functions) == {"m": 1, "m-whole": 0, "m-s0": 1, "m-s1": 1, "m-s2": 1, "m-s3": 1}
    assert store.layout("m") == PIPELINED and "4 stage functions" in store.layout_changes("m")[-1].reason


def test_no_choice_unless_every_stage_function_sleeps_and_the_whole_one_is_at_zero():
    for functions in (model(sleeping=3), model(whole_desired=1)):
        store = MemoryStore()
        activator(store, 5.0).wake(functions, functions[0], now=10.0)
        assert store.layout_changes("m") == []  # nothing chosen, nothing recorded
        assert desired(functions)["m-whole"] == (1 if functions[1].desired else 0)
