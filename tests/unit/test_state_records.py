"""Each record that crosses a process reads back as it was written, from the bytes Redis returns."""
from __future__ import annotations

import pytest

from contracts.stage import StageRef
from state.records import (
    CacheEvent,
    ColdStart,
    DecisionRecord,
    LayoutChange,
    Placement,
    ReplicaRecord,
    StageSample,
    StartFailure,
    ZygoteRecord,
    decode_key_stages,
    encode_key_stages,
)


def _as_redis(mapping: dict[str, str]) -> dict[bytes, bytes]:
    return {k.encode(): v.encode() for k, v in mapping.items()}


def test_a_replica_record_round_trips_through_redis_bytes():
    rec = ReplicaRecord("m-s1-3.vm.42", "m", 1, 3, "vm", 42, "cpu", 2, "fork-cow", 1.5, 2.5, True, 3, 4096, 7.25,
                        ColdStart(1.0, 2.0, 3.0, 4.0, 5.0, 600))
    assert ReplicaRecord.decode(_as_redis(rec.encode())) == rec
    assert ReplicaRecord.decode(rec.encode()) == rec
    assert rec.stage == StageRef("m", 1, 3) and rec.serves(StageRef("m", 1, 3)) and not rec.serves(StageRef("m", 1, 2))


def test_what_a_replica_has_not_reported_yet_reads_as_its_default():
    minimal = {"replica_id": "m-s0.vm.1", "model": "m", "stage_start": "0", "stage_end": "1", "server": "vm", "pid": "1"}
    rec = ReplicaRecord.decode(_as_redis(minimal))
    assert (rec.draining, rec.sequences, rec.kv_bytes, rec.cpus, rec.first_work_at, rec.coldstart) == \
        (False, 0, 0, 1, None, None)
    # A replica that is not draining writes no flag: an absent field and "0" both read as not draining.
    assert "draining" not in rec.encode()


def test_a_record_without_its_identity_is_refused():
    with pytest.raises(KeyError):
        ReplicaRecord.decode({b"cpus": b"2"})


def test_a_stage_sample_round_trips_with_its_stream_time():
    sample = StageSample("abc.0.3", 1700000000.123456, 1.25, 40.5, "m-s1.vm.2", "decode", 8)
    got = StageSample.decode(b"1700000000500-3", _as_redis(sample.encode()))
    assert got == StageSample("abc.0.3", 1700000000.123456, 1.25, 40.5, "m-s1.vm.2", "decode", 8, at_ms=1700000000500)
    assert not got.starts_request and StageSample("a", 0, 0, 0, "r", "prefill").starts_request
    compiled = StageSample("abc.0.4", 1.0, 1.0, 4.0, "m-s1.vm.2", "decode", 2, compiled=True, threads=2)
    back = StageSample.decode(b"1000-0", _as_redis(compiled.encode()))
    assert back.compiled and back.threads == 2 and not got.compiled and got.threads == 1


def test_cold_starts_failures_and_key_stages_round_trip():
    cold = ColdStart(1.0, 2.0, 3.0, 4.5, 6.0, 123)
    assert ColdStart.decode(cold.encode().encode()) == cold and cold.load_after_fetch_s == 1.5
    assert ColdStart.decode('{"loaded_at": 2.0, "later_field": 1}') == ColdStart(loaded_at=2.0)  # a newer writer's field is ignored
    failure = StartFailure("checksum", 9.5)
    assert StartFailure.decode(failure.encode().encode()) == failure
    stages = (StageRef("m", 1, 3), StageRef("m", 4, 5))
    assert decode_key_stages("m", encode_key_stages(stages).encode()) == list(stages)


def test_the_control_planes_logs_round_trip():
    placement = Placement("add", "m:1-3", "fewest replicas", "vs-1", "fork", "m-s1-3.vs-1.9", "fork-cow", "light", 12.5)
    assert Placement.decode(_as_redis(placement.encode())) == placement
    # What a removal or an unplaced replica leaves out reads back empty, not as a missing field.
    assert Placement.decode(Placement("unplaced", "m:0", "no room", t=3.0).encode()) == Placement("unplaced", "m:0", "no room", t=3.0)
    ready = Placement("ready", "m:1", "ready 2.10 s after it was placed", "vs-2", "peer", "m-s1.vs-2.7", "cold",
                      t=4.0, predicted_s=1.5, took_s=2.1)
    assert Placement.decode(_as_redis(ready.encode())) == ready
    decision = DecisionRecord(7.5, "quart", (1, 2), (1, 3), ("1",), ({"stage": "0", "replicas": 1}, {"stage": "1", "replicas": 3}))
    assert DecisionRecord.decode(_as_redis(decision.encode())) == decision
    change = LayoutChange(1.25, "consolidating", "8 requests over 3 windows")
    assert LayoutChange.decode(_as_redis(change.encode())) == change
    event = CacheEvent("fork", "m:2", 77, 5.5, (("child", "88"), ("cow", "True")))
    assert CacheEvent.decode(_as_redis(event.encode())) == event
    with pytest.raises(ValueError, match="pid"):   # the zygote's pid is not overwritten by the child's
        CacheEvent("fork", "m:2", 77, 5.5, (("pid", "88"),))
    zygote = ZygoteRecord("vs-0", "m", "1-3", 42, 1 << 20, ("ab", "cd"), 1.0, 2.0, 3)
    assert ZygoteRecord.decode(_as_redis(zygote.encode())) == zygote and zygote.stage == StageRef("m", 1, 3)
