"""QUART §6.2 (Eq. 8-10): move the placement matrix P (instances x servers) towards a dispersed
target Q by gradient descent on D_KL(P || Q), keeping P a valid distribution within capacity.

Eq. 10 as printed (P <- P - a * (1 + log P/Q)) leaves the simplex: entries go negative and the
log is undefined. We take the same gradient step in the mirror (log) space instead, the standard
way to descend on distributions: P <- normalise(P * exp(-a * grad)) = normalise(P^(1-a) Q^a).
Every row stays a distribution; the column sums (expected instances per server) are then scaled
back under capacity, and a step that would raise the objective is retried with half the rate,
so the objective never increases."""
from __future__ import annotations

import numpy as np

EPS = 1e-12


def kl_divergence(P: np.ndarray, Q: np.ndarray) -> float:
    """Eq. 8 summed over instances (rows); zero entries of P contribute nothing."""
    P = np.maximum(P, EPS)
    return float(np.sum(P * (np.log(P) - np.log(np.maximum(Q, EPS)))))


def _normalise_rows(P: np.ndarray) -> np.ndarray:
    return P / P.sum(axis=1, keepdims=True)


def within_capacity(P: np.ndarray, capacity: np.ndarray, rounds: int = 200) -> np.ndarray:
    """Alternately scales over-full columns down and rows back to one (Sinkhorn-style), so that
    no server expects more instances than it has room for. Needs rows <= capacity.sum()."""
    P = P.copy()
    for _ in range(rounds):
        load = P.sum(axis=0)
        over = load > capacity * (1 + 1e-4) + 1e-9
        if not over.any():
            break
        P *= np.where(over, capacity / np.maximum(load, EPS), 1.0)  # zeros (masked) stay zero
        P /= P.sum(axis=1, keepdims=True)
    return P


def descend(P: np.ndarray, Q: np.ndarray, capacity: np.ndarray, *, rate: float = 0.5,
            threshold: float = 0.0, max_iters: int = 50, tol: float = 1e-6,
            min_rate: float = 1e-3) -> tuple[np.ndarray, list[float]]:
    """Descends from P towards Q until the mean divergence per instance is at most `threshold`,
    stops improving by `tol`, or `max_iters` steps. Returns P and the objective at every step."""
    mask = Q > 0
    logq = np.log(np.maximum(Q, EPS))
    P = within_capacity(_normalise_rows(np.where(mask, np.maximum(P, EPS), 0.0)), capacity)
    trace = [kl_divergence(P, Q)]
    rows = max(1, P.shape[0])
    for _ in range(max_iters):
        if trace[-1] / rows <= threshold:
            break
        step = rate
        while step >= min_rate:
            logp = np.log(np.maximum(P, EPS))
            candidate = np.where(mask, np.exp((1 - step) * logp + step * logq), 0.0)
            candidate = within_capacity(_normalise_rows(candidate), capacity)
            value = kl_divergence(candidate, Q)
            if value <= trace[-1]:
                break
            step /= 2
        else:
            break  # no step lowers the objective: converged
        improvement = trace[-1] - value
        P = candidate
        trace.append(value)
        if improvement < tol:
            break
    return P, trace


def round_counts(expected: np.ndarray, total: int, room: np.ndarray) -> np.ndarray:
    """Integer counts per server that sum to `total` (or to all the room there is), never above
    `room`: the floors of the expected counts, then the largest remainders."""
    counts = np.minimum(np.floor(expected).astype(int), room)
    left = total - int(counts.sum())
    order = np.argsort(-(expected - counts), kind="stable")
    while left > 0:
        progressed = False
        for j in order:
            if left == 0:
                break
            if counts[j] < room[j]:
                counts[j] += 1
                left -= 1
                progressed = True
        if not progressed:
            break
    return counts
