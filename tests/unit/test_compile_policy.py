"""When a replica's background compile may start: once the replica idles, or when it has waited
as long as it may."""
from engine.compile_policy import QUIET_S, compile_may_start


def test_a_compile_waits_while_the_replica_holds_a_sequence_or_has_just_stepped():
    assert not compile_may_start(waited_s=5.0, idle_s=10.0, holding=True, defer_s=30.0)
    assert not compile_may_start(waited_s=5.0, idle_s=QUIET_S / 2, holding=False, defer_s=30.0)


def test_a_replica_that_has_run_no_step_yet_is_not_idle_it_is_about_to_get_work():
    assert not compile_may_start(waited_s=10.0, idle_s=None, holding=False, defer_s=30.0)
    assert compile_may_start(waited_s=30.0, idle_s=None, holding=False, defer_s=30.0)


def test_a_compile_starts_once_the_replica_idles():
    assert compile_may_start(waited_s=0.0, idle_s=QUIET_S, holding=False, defer_s=30.0)


def test_a_compile_starts_under_steady_load_once_it_has_waited_its_longest():
    assert compile_may_start(waited_s=30.0, idle_s=0.0, holding=True, defer_s=30.0)
    assert compile_may_start(waited_s=0.0, idle_s=0.0, holding=True, defer_s=0.0), "0: at once"
