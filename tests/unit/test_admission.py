"""The entry's admission rule, on its own: time in, decision out."""
from pipeline.admission import Admission


def test_admits_while_first_passes_do_not_queue():
    a = Admission(max_wait_s=1.0)
    assert a.refusal(0.0) is None
    a.sent("r1", 0.0)
    a.answered("r1", service_s=0.5)
    for i in range(5):
        a.sent(f"q{i}", 10.0)
    # Waited 1.4 s, of which a pass takes 0.5 s: queued 0.9 s, under the bound.
    assert a.refusal(11.4) is None


def test_refuses_once_the_oldest_waiting_pass_has_queued_past_the_bound():
    a = Admission(max_wait_s=1.0)
    a.sent("slow", 0.0)
    a.sent("later", 2.0)
    retry = a.refusal(3.5)
    assert retry is not None and retry >= 1.0
    assert a.queued_s(3.5) == 3.5
    a.answered("slow", service_s=None)  # given up on: it no longer counts
    assert a.refusal(2.9) is None and a.refusal(3.5) is not None


def test_a_pass_that_takes_long_is_not_mistaken_for_queueing():
    a = Admission(max_wait_s=1.0)
    for i in range(10):
        a.sent(f"r{i}", float(i))
        a.answered(f"r{i}", service_s=5.0)
    a.sent("now", 100.0)
    assert a.refusal(105.5) is None
    assert a.refusal(106.5) is not None


def test_zero_admits_everything():
    a = Admission(max_wait_s=0.0)
    a.sent("r", 0.0)
    assert a.refusal(1e6) is None
