"""Arrival processes: Gamma inter-arrivals with a rate and CV (QUART §8 uses CV 0.1-8), Poisson,
the Azure Functions 2019 trace (invocations per minute, spread with Gamma inter-arrivals as in
HydraServe §8.3), and BurstGPT (arrival times with prompt and answer lengths); and, where those
traces are not at hand, generated shapes after each (bursty spells, a daily cycle). Every schedule is
a function of its seed. Times are seconds from the start of the replay."""
from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np

AZURE_HEADER = ["HashOwner", "HashApp", "HashFunction", "Trigger"]
AZURE_MINUTES = 1440
BURSTGPT_HEADER = ["Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type"]


class TraceError(ValueError):
    """A trace file that is not what its reader expects."""


def gamma_gaps(rng: np.random.Generator, rate: float, cv: float, n: int) -> np.ndarray:
    """n inter-arrival times with mean 1/rate and coefficient of variation cv (shape 1/cv^2)."""
    if rate <= 0 or cv <= 0:
        raise ValueError(f"rate and cv must be positive, got rate={rate}, cv={cv}")
    shape = 1.0 / (cv * cv)
    return rng.gamma(shape, 1.0 / (rate * shape), size=n)


def gamma_arrivals(rate: float, cv: float, duration_s: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    times = np.empty(0)
    while not len(times) or times[-1] < duration_s:
        more = np.cumsum(gamma_gaps(rng, rate, cv, max(16, int(rate * duration_s * 1.2))))
        times = np.concatenate([times, (times[-1] if len(times) else 0.0) + more])
    return times[times < duration_s]


def poisson_arrivals(rate: float, duration_s: float, seed: int) -> np.ndarray:
    return gamma_arrivals(rate, 1.0, duration_s, seed)


def bursty_arrivals(rate: float, duration_s: float, seed: int, burst_factor: float = 8.0, calm_s: float = 30.0,
                    burst_s: float = 8.0, cv: float = 1.5, tail: float = 2.5) -> np.ndarray:
    """Shaped after BurstGPT's serving logs, where the rate jumps several-fold for seconds to
    minutes: calm and burst spells alternate, each spell's length heavy-tailed (Pareto with shape
    `tail`, means `calm_s` and `burst_s`), the burst rate `burst_factor` times the calm one, Gamma
    inter-arrivals of `cv` within a spell, and `rate` the long-run mean. A shape with chosen
    parameters, not a fit to the published trace (`read_burstgpt` replays that)."""
    if rate <= 0 or burst_factor < 1 or tail <= 1:
        raise ValueError(f"rate > 0, burst_factor >= 1 and tail > 1, got {rate}, {burst_factor}, {tail}")
    rng = np.random.default_rng(seed)
    calm_rate = rate * (calm_s + burst_s) / (calm_s + burst_factor * burst_s)
    times, t, burst = [], 0.0, bool(rng.random() < burst_s / (calm_s + burst_s))
    while t < duration_s:
        mean = burst_s if burst else calm_s
        length = mean * (tail - 1) / tail * (1.0 + rng.pareto(tail))  # Pareto (Lomax + 1) with this mean
        spell_rate = calm_rate * (burst_factor if burst else 1.0)
        gaps = gamma_gaps(rng, spell_rate, cv, max(4, int(spell_rate * length * 2) + 4))
        inside = t + np.cumsum(gaps)
        times.append(inside[inside < t + length])
        t, burst = t + length, not burst
    out = np.concatenate(times)
    return out[out < duration_s]


def in_burst(arrivals: np.ndarray, at: np.ndarray, rate: float, factor: float = 2.0, window_s: float = 2.0) -> np.ndarray:
    """Which of the times `at` fall in a burst of `arrivals`: where the arrivals within the
    `window_s` around it run at `factor` times the long-run `rate` or more. `bursty_arrivals`'
    bursts run at about 3.2x the mean and its calm spells at 0.4x; at 2x this marks 65 % of its
    requests (68 % arrive in bursts) and 0.1 % of a Poisson stream's."""
    ordered = np.sort(arrivals)
    half = window_s / 2
    count = np.searchsorted(ordered, at + half) - np.searchsorted(ordered, at - half)
    return count / window_s >= factor * rate


def diurnal_arrivals(rate: float, duration_s: float, seed: int, amplitude: float = 0.6, days: float = 1.0,
                     bins: int = 120, cv: float = 1.0) -> np.ndarray:
    """Shaped after the Azure Functions trace's daily cycle, compressed into the run: `days` cycles
    of rate x (1 - amplitude x cos(2 pi t / day)) (trough at the start, peak/trough
    (1 + amplitude) / (1 - amplitude)), counted per bin and spread within each bin with Gamma
    inter-arrivals of `cv`, as `azure_arrivals` spreads a trace's minutes. Mean `rate`."""
    if rate <= 0 or not 0 <= amplitude < 1 or days <= 0 or bins < 1:
        raise ValueError(f"rate > 0, 0 <= amplitude < 1, days > 0, bins >= 1; got {rate}, {amplitude}, {days}, {bins}")
    width = duration_s / bins
    mids = (np.arange(bins) + 0.5) * width
    expected = rate * width * (1.0 - amplitude * np.cos(2 * np.pi * days * mids / duration_s))
    return azure_arrivals(expected, cv, seed, minute_s=width)


@dataclass(frozen=True)
class AzureFunction:
    owner: str
    app: str
    function: str
    trigger: str
    per_minute: np.ndarray  # invocations in each of the day's 1440 minutes

    @property
    def total(self) -> int:
        return int(self.per_minute.sum())


def read_azure(path: str | Path) -> list[AzureFunction]:
    """`invocations_per_function_md.anon.dNN.csv`: HashOwner,HashApp,HashFunction,Trigger,1..1440."""
    out = []
    with open(path, newline="") as f:
        rows = csv.reader(f)
        header = next(rows, None)
        expected = AZURE_HEADER + [str(m) for m in range(1, AZURE_MINUTES + 1)]
        if header != expected:
            raise TraceError(f"{path}: not an Azure Functions invocation file (header starts "
                             f"{(header or [])[:6]}, expected {expected[:6]}... 1440)")
        for line, row in enumerate(rows, start=2):
            if len(row) != len(expected):
                raise TraceError(f"{path}:{line}: {len(row)} columns, expected {len(expected)}")
            try:
                counts = np.array([int(x) for x in row[4:]], dtype=np.int64)
            except ValueError as exc:
                raise TraceError(f"{path}:{line}: {exc}") from exc
            if (counts < 0).any():
                raise TraceError(f"{path}:{line}: negative invocation count")
            out.append(AzureFunction(*row[:4], counts))
    return out


def pick_functions(functions: list[AzureFunction], count: int, seed: int, min_total: int = 1) -> list[AzureFunction]:
    """`count` functions with at least `min_total` invocations in the day, sampled with the seed."""
    eligible = [f for f in functions if f.total >= min_total]
    if len(eligible) < count:
        raise TraceError(f"only {len(eligible)} functions have >= {min_total} invocations; asked for {count}")
    rng = np.random.default_rng(seed)
    return [eligible[i] for i in sorted(rng.choice(len(eligible), size=count, replace=False))]


def azure_arrivals(per_minute: np.ndarray, cv: float, seed: int, minute_s: float = 60.0, scale: float = 1.0,
                   start_minute: int = 0, minutes: int | None = None) -> np.ndarray:
    """Each minute's invocations (times `scale`, rounded at random) spread over the minute with
    Gamma inter-arrivals of the given CV. `minute_s` < 60 compresses time."""
    rng = np.random.default_rng(seed)
    window = per_minute[start_minute:None if minutes is None else start_minute + minutes]
    times = []
    for m, count in enumerate(window):
        expected = count * scale
        n = int(expected) + int(rng.random() < expected - int(expected))
        if n == 0:
            continue
        gaps = gamma_gaps(rng, 1.0, cv, n + 1)
        # n arrivals inside the minute: the gaps are scaled to fill it, keeping their CV.
        times.append(m * minute_s + np.cumsum(gaps)[:n] / gaps.sum() * minute_s)
    return np.concatenate(times) if times else np.empty(0)


@dataclass(frozen=True)
class BurstRequest:
    at: float
    model: str
    request_tokens: int
    response_tokens: int
    log_type: str


def read_burstgpt(path: str | Path, model: str | None = None, log_type: str | None = None,
                  limit: int | None = None, time_scale: float = 1.0) -> list[BurstRequest]:
    """BurstGPT rows (Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type), kept
    for one model and log type if given, times made relative to the first kept row and divided
    by `time_scale`; rows with zero response tokens (failed) are dropped, as BurstGPT advises."""
    out = []
    with open(path, newline="") as f:
        rows = csv.reader(f)
        header = next(rows, None)
        if header != BURSTGPT_HEADER:
            raise TraceError(f"{path}: not a BurstGPT file (header {header}, expected {BURSTGPT_HEADER})")
        for line, row in enumerate(rows, start=2):
            if len(row) != len(BURSTGPT_HEADER):
                raise TraceError(f"{path}:{line}: {len(row)} columns, expected {len(BURSTGPT_HEADER)}")
            if (model and row[1] != model) or (log_type and row[5] != log_type):
                continue
            try:
                at, request, response = float(row[0]), int(row[2]), int(row[3])
            except ValueError as exc:
                raise TraceError(f"{path}:{line}: {exc}") from exc
            if response == 0:
                continue
            out.append(BurstRequest(at, row[1], request, response, row[5]))
            if limit is not None and len(out) >= limit:
                break
    out.sort(key=lambda r: r.at)
    if out:
        first = out[0].at
        out = [BurstRequest((r.at - first) / time_scale, r.model, r.request_tokens, r.response_tokens, r.log_type)
               for r in out]
    return out
