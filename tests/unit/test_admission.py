"""The entry's admission rule, on its own: time in, decision out."""
from frontend.admission import MIN_IN_FLIGHT, Admission


def serve(a: Admission, t0: float, n: int, gap_s: float, service_s: float) -> float:
    """n first passes, one every gap_s, each answered service_s after it was sent; the end time."""
    for i in range(n):
        a.sent(f"p{t0}-{i}", t0 + i * gap_s)
        a.answered(f"p{t0}-{i}", service_s, t0 + i * gap_s + service_s)
    return t0 + n * gap_s


def test_admits_while_the_stages_keep_up():
    a = Admission(max_wait_s=1.0)
    assert a.refusal(0.0) is None
    now = serve(a, 0.0, 20, gap_s=0.2, service_s=0.5)
    a.sent("next", now)
    assert a.refusal(now + 0.1) is None


def test_refuses_before_a_queue_longer_than_the_bound_forms():
    a = Admission(max_wait_s=1.0)
    # Five answered a second, then 20 in flight at once: a new one would take 21/5 s, 3.7 s
    # beyond a pass's 0.5 s and over the bound, though none has waited long yet.
    a.sent("busy", 0.0)
    now = serve(a, 0.0, 10, gap_s=0.2, service_s=0.5)
    for i in range(20):
        a.sent(f"q{i}", now)
    retry = a.refusal(now + 0.01)
    assert retry is not None and retry >= 1.0
    assert a.predicted_s(now + 0.01) > 3.0


def test_refuses_once_the_oldest_waiting_pass_has_queued_past_the_bound():
    a = Admission(max_wait_s=1.0)
    a.sent("slow", 0.0)
    for i in range(4):
        a.sent(f"later{i}", 2.0)
    assert a.refusal(3.5) is not None and a.queued_s(3.5) == 3.5
    a.answered("slow", service_s=None, now=3.5)  # given up on: it no longer counts
    assert a.refusal(2.9) is None and a.refusal(3.5) is not None


def test_a_few_passes_in_flight_are_never_refused():
    a = Admission(max_wait_s=1.0)
    for i in range(MIN_IN_FLIGHT - 1):
        a.sent(f"stalled{i}", 0.0)   # a stall: nothing answers for a while
    assert a.refusal(60.0) is None


def test_a_pass_that_takes_long_is_not_mistaken_for_queueing():
    a = Admission(max_wait_s=1.0)
    for i in range(10):
        a.sent(f"r{i}", 10.0 * i)
        a.answered(f"r{i}", 5.0, 10.0 * i + 5.0)
    for i in range(MIN_IN_FLIGHT):
        a.sent(f"now{i}", 100.0)
    assert a.refusal(105.5) is None
    assert a.refusal(106.5) is not None


def test_zero_admits_everything():
    a = Admission(max_wait_s=0.0)
    a.sent("r", 0.0)
    assert a.refusal(1e6) is None
