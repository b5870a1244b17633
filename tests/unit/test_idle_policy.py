"""Scale to zero's labels (contracts/stack.py) and rule (autoscaler/policy/idle.py)."""
from __future__ import annotations

import pytest

from autoscaler.policy.idle import ModelActivity, decide
from contracts.stack import DEFAULT_ZERO_DURATION_S, ZeroScaling, parse_duration


def test_go_durations():
    assert parse_duration("15m") == 900 and parse_duration("1h30m") == 5400
    assert parse_duration("90s") == 90 and parse_duration("500ms") == 0.5 and parse_duration("1.5s") == 1.5
    for bad in ("", "15", "m", "15 m", "-5s", "1d", "5s junk"):
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_labels():
    assert ZeroScaling.from_labels({}) == ZeroScaling(False, DEFAULT_ZERO_DURATION_S)
    assert ZeroScaling.from_labels({"com.openfaas.scale.zero": "true",
                                    "com.openfaas.scale.zero-duration": "30s"}) == ZeroScaling(True, 30.0)
    with pytest.raises(ValueError, match="true or false"):
        ZeroScaling.from_labels({"com.openfaas.scale.zero": "yes"})
    with pytest.raises(ValueError, match="zero-duration"):
        ZeroScaling.from_labels({"com.openfaas.scale.zero-duration": "later"})


def test_sleep_only_when_idle_long_enough_and_holding_no_work():
    assert decide(100.0, ModelActivity(last_request_at=80.0, idle_s=15.0, replicas=4, work=0)) == "sleep"
    assert decide(100.0, ModelActivity(last_request_at=90.0, idle_s=15.0, replicas=4, work=0)) is None
    assert decide(100.0, ModelActivity(last_request_at=80.0, idle_s=15.0, replicas=4, work=1)) is None


def test_wake_when_work_waits_at_zero():
    assert decide(100.0, ModelActivity(last_request_at=0.0, idle_s=15.0, replicas=0, work=2)) == "wake"
    assert decide(100.0, ModelActivity(last_request_at=0.0, idle_s=15.0, replicas=0, work=0)) is None
