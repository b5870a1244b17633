"""What a replay measured (QUART §8): latency percentiles, SLO attainment for SLOs of 1x to 3x
the profiled latency (Fig. 6b), goodput (requests and tokens answered within the SLO per second),
and the cost in replica-seconds. For generations also (HydraServe §7): time to first token (TTFT)
and time per output token (TPOT) percentiles, SLO attainment on each separately (TTFT SLO: 5x the
warm TTFT; TPOT SLO: one per model), and token goodput (output tokens of requests that met both)."""
from __future__ import annotations

import math

import numpy as np

from loadgen.client import Record

SLO_SCALES = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0)
# HydraServe's TTFT SLO: this many times the model's warm (unloaded) TTFT.
TTFT_SLO_SCALE = 5.0


def latency_summary(latencies_s: list[float]) -> dict[str, float]:
    """Mean and percentiles (linear interpolation, numpy's default), in seconds."""
    if not latencies_s:
        return {k: math.nan for k in ("mean", "p50", "p75", "p90", "p99")}
    a = np.asarray(latencies_s, dtype=float)
    return {"mean": float(a.mean()), **{f"p{q}": float(np.percentile(a, q)) for q in (50, 75, 90, 99)}}


def slo_attainment(records: list[Record], slo_s: float) -> float:
    """Share of all requests sent that were answered 200 within the SLO; failures count as misses."""
    sent = [r for r in records if r.sent >= 0]
    return sum(1 for r in sent if r.ok and r.latency_s <= slo_s) / len(sent) if sent else math.nan


def goodput(records: list[Record], slo_s: float, duration_s: float) -> dict[str, float]:
    """Requests and tokens (prompt + output) answered within the SLO, per second of the trace."""
    good = [r for r in records if r.ok and 0 <= r.latency_s <= slo_s]
    return {"requests_per_s": len(good) / duration_s,
            "tokens_per_s": sum(r.prompt_tokens + r.output_tokens for r in good) / duration_s}


def schedule_error(records: list[Record]) -> dict[str, float]:
    errors = np.array([r.schedule_error_s for r in records if r.sent >= 0]) * 1000.0
    if not len(errors):
        return {"p50_ms": math.nan, "p99_ms": math.nan, "max_ms": math.nan}
    return {"p50_ms": float(np.percentile(errors, 50)), "p99_ms": float(np.percentile(errors, 99)),
            "max_ms": float(errors.max())}


def token_metrics(records: list[Record], ttft_slo_s: float, tpot_slo_s: float, duration_s: float) -> dict:
    """TTFT and TPOT percentiles of the answered generations, the share of all generations sent
    that met each SLO (failures are misses), and output tokens per second of those that met both."""
    sent = [r for r in records if r.sent >= 0]
    ok = [r for r in sent if r.ok and r.ttft_s >= 0]
    met_ttft = [r for r in ok if r.ttft_s <= ttft_slo_s]
    met_tpot = [r for r in ok if r.tpot_s <= tpot_slo_s]
    both = [r for r in met_ttft if r.tpot_s <= tpot_slo_s]
    share = (lambda n: n / len(sent)) if sent else (lambda n: math.nan)
    return {"ttft_s": latency_summary([r.ttft_s for r in ok]),
            "tpot_s": latency_summary([r.tpot_s for r in ok if r.output_tokens > 1]),
            "ttft_slo_s": ttft_slo_s, "tpot_slo_s": tpot_slo_s,
            "ttft_attainment": share(len(met_ttft)), "tpot_attainment": share(len(met_tpot)),
            "token_goodput_per_s": sum(r.output_tokens for r in both) / duration_s}


def summarize(records: list[Record], profiled_s: float, duration_s: float, replica_seconds: float = math.nan,
              slo_scale: float = 2.0, warm_ttft_s: float | None = None, tpot_slo_s: float | None = None) -> dict:
    """Everything the report shows for one run. `profiled_s`: the model's unloaded latency; the
    goodput's SLO is `slo_scale` times it. With `warm_ttft_s` and `tpot_slo_s` (a generative
    model), the token metrics too."""
    ok = [r.latency_s for r in records if r.ok]
    tokens = {} if warm_ttft_s is None or tpot_slo_s is None else \
        {"tokens": token_metrics(records, TTFT_SLO_SCALE * warm_ttft_s, tpot_slo_s, duration_s)}
    return {
        **tokens,
        "sent": sum(1 for r in records if r.sent >= 0), "ok": len(ok),
        "failed": sum(1 for r in records if r.sent >= 0 and not r.ok),
        "latency_s": latency_summary(ok),
        "slo_attainment": {f"{k:g}": slo_attainment(records, k * profiled_s) for k in SLO_SCALES},
        "goodput": goodput(records, slo_scale * profiled_s, duration_s),
        "slo_scale": slo_scale, "profiled_s": profiled_s, "duration_s": duration_s,
        "replica_seconds": replica_seconds, "schedule_error": schedule_error(records),
    }
