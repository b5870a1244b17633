"""A stand-in replica (execute-while-load) in the provider's records: it survives the state file
that a provider started in a dead one's place adopts, and it is not its function's own."""
from __future__ import annotations

import subprocess
from pathlib import Path

from runtime.functions import FunctionState, ReplicaProcess
from scheduler.state import ReplicaId


def test_a_stand_in_is_adopted_as_one_and_does_not_count_towards_desired(tmp_path):
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    try:
        whole = ReplicaId("vs-2", 4242)
        own = ReplicaProcess(procs[0], tmp_path / "a.port", "vs-1")
        stand_in = ReplicaProcess(procs[1], tmp_path / "b.port", "vs-2", stands_in_for=whole)
        fn = FunctionState({"service": "m-s0", "envVars": {"QUART_STAGES": "0"}}, Path("handler"), 1,
                           replicas=[own, stand_in])
        assert fn.serving() == [own, stand_in] and fn.own() == [own]
        adopted = FunctionState.restore(fn.snapshot(), Path("handler"))
        assert [r.stands_in_for for r in adopted.replicas] == [None, whole]
        assert [r.pid for r in adopted.own()] == [own.pid]
    finally:
        for p in procs:
            p.kill()
            p.wait()
