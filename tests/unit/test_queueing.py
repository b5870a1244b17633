"""Queueing formulas against textbook values (Gross & Harris style worked examples)."""
from __future__ import annotations

import math

import pytest

from autoscaler.policy.queueing import allen_cunneen_wait, erlang_b, erlang_c, min_servers, mmc_sojourn, mmc_wait


@pytest.mark.parametrize("lam,mu,c,wq", [
    (0.5, 1.0, 1, 1.0),            # M/M/1: rho / (mu - lambda)
    (2.0, 1.0, 3, 4.0 / 9.0),      # M/M/3, a = 2: C = 4/9, cmu - lambda = 1
    (1.5, 1.0, 2, 9.0 / 7.0),      # M/M/2, a = 1.5: C = 9/14, cmu - lambda = 0.5
    (8.0, 2.0, 5, 0.5541 / 2.0),   # M/M/5, a = 4: C = 0.5541
])
def test_mmc_wait_matches_textbook_values(lam, mu, c, wq):
    assert mmc_wait(lam, mu, c) == pytest.approx(wq, rel=1e-3)
    assert mmc_sojourn(lam, mu, c) == pytest.approx(wq + 1 / mu, rel=1e-3)


def test_erlang_b_and_c_known_values():
    assert erlang_b(1, 1.0) == pytest.approx(0.5)
    assert erlang_b(2, 1.0) == pytest.approx(0.2)
    assert erlang_c(3, 2.0) == pytest.approx(4 / 9)


def test_unstable_and_idle_queues():
    assert mmc_wait(3.0, 1.0, 3) == math.inf
    assert mmc_wait(5.0, 1.0, 2) == math.inf
    assert mmc_sojourn(5.0, 1.0, 2) == math.inf
    assert mmc_wait(0.0, 1.0, 2) == 0.0
    assert mmc_wait(1.0, 1.0, 0) == math.inf


def test_stable_at_a_thousand_servers():
    # a = 950 on 1000 servers: no overflow, a small finite wait, and monotone in c.
    w1000 = mmc_wait(950.0, 1.0, 1000)
    assert 0 < w1000 < 0.05 and math.isfinite(w1000)
    assert mmc_wait(950.0, 1.0, 1001) < w1000
    assert erlang_c(1000, 999.0) < 1.0


def test_allen_cunneen_scales_the_mmc_wait():
    base = mmc_wait(2.0, 1.0, 3)
    assert allen_cunneen_wait(2.0, 1.0, 3, 1.0, 1.0) == pytest.approx(base)
    assert allen_cunneen_wait(2.0, 1.0, 3, 16.0, 0.0) == pytest.approx(8 * base)
    assert allen_cunneen_wait(2.0, 1.0, 3, 0.0, 0.0) == 0.0


def test_min_servers_is_the_smallest_meeting_the_target():
    c = min_servers(10.0, 1.0, target_wait=0.1)
    assert allen_cunneen_wait(10.0, 1.0, c, 1, 1) <= 0.1 < allen_cunneen_wait(10.0, 1.0, c - 1, 1, 1)
    # Burstier arrivals need more servers for the same target.
    assert min_servers(10.0, 1.0, 0.1, ca2=16.0) > c
    assert min_servers(0.0, 1.0, 0.1) == 0
