"""Queueing formulas the policies use. Pure functions, no I/O.

QUART's Eq. 1 is not the textbook M/M/c waiting time (its first term mixes the idle probability
P0 with a single-server form); these are the textbook formulas: Erlang C for the probability of
waiting, Wq = C / (c·μ − λ) for the mean wait, W = Wq + 1/μ for the sojourn time. Erlang C is
computed through the Erlang B recursion, which needs no factorials and stays stable at c = 1000.
"""
from __future__ import annotations

import math

INF = math.inf


def erlang_b(servers: int, load: float) -> float:
    """Blocking probability of M/M/c/c with offered load a = λ/μ (the stable recursion)."""
    if servers < 0 or load < 0:
        raise ValueError("servers and load must be non-negative")
    b = 1.0
    for k in range(1, servers + 1):
        b = load * b / (k + load * b)
    return b


def erlang_c(servers: int, load: float) -> float:
    """Probability that an arrival waits in M/M/c, with a = λ/μ < c; 1 when the queue is unstable."""
    if servers <= 0 or load >= servers:
        return 1.0
    if load == 0:
        return 0.0
    b = erlang_b(servers, load)
    rho = load / servers
    return b / (1.0 - rho * (1.0 - b))


def mmc_wait(arrival_rate: float, service_rate: float, servers: int) -> float:
    """Mean time in queue (seconds) of M/M/c; infinite when λ ≥ c·μ."""
    if service_rate <= 0 or servers <= 0:
        return INF
    capacity = servers * service_rate
    if arrival_rate >= capacity:
        return INF
    if arrival_rate <= 0:
        return 0.0
    return erlang_c(servers, arrival_rate / service_rate) / (capacity - arrival_rate)


def mmc_sojourn(arrival_rate: float, service_rate: float, servers: int) -> float:
    """Mean time in system (queue + service) of M/M/c."""
    wait = mmc_wait(arrival_rate, service_rate, servers)
    return wait + 1.0 / service_rate if math.isfinite(wait) else INF


def allen_cunneen_wait(arrival_rate: float, service_rate: float, servers: int, ca2: float, cs2: float) -> float:
    """G/G/c mean wait by Allen–Cunneen: the M/M/c wait scaled by (Ca² + Cs²) / 2, where Ca and Cs
    are the coefficients of variation of inter-arrival and service times."""
    wait = mmc_wait(arrival_rate, service_rate, servers)
    return wait * (ca2 + cs2) / 2.0 if math.isfinite(wait) else INF


def min_servers(arrival_rate: float, service_rate: float, target_wait: float, ca2: float = 1.0,
                cs2: float = 1.0, limit: int = 1000) -> int:
    """The fewest servers whose Allen–Cunneen wait is at most `target_wait` (at most `limit`).
    Steps the Erlang B recursion one server at a time, so the search costs O(c), not O(c²)."""
    if arrival_rate <= 0:
        return 0
    load = arrival_rate / service_rate
    c = max(1, math.floor(load) + 1)
    b = erlang_b(c, load)
    scale = (ca2 + cs2) / 2.0
    while c < limit:
        rho = load / c
        wait = b / (1.0 - rho * (1.0 - b)) / (c * service_rate - arrival_rate) * scale
        if wait <= target_wait:
            return c
        c += 1
        b = load * b / (c + load * b)
    return limit
