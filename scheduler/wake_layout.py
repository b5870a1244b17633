"""Which of its declared layouts a model wakes in from zero: HydraServe's Algorithm 1
(scheduler/coldstart.py) over the runtime's servers, restricted to the pipeline sizes the model
declares: 1, its whole-model function, or N, its N stage functions. Each worker of either is a
full one (a replica computes its part on its own cores), so a layout of s workers costs s
replicas, and the whole model wakes wherever it can give its first token within the objective;
the stage functions where only they can, each fetching its part over a server of its own. Where
the servers are emulated on one host (the embedded runtime's virtual servers), its cores bound a
layout's start from below: s workers import their libraries s times. Pure: measured costs and
servers in, a choice out."""
from __future__ import annotations

import math
from dataclasses import dataclass

from scheduler.coldstart import ColdServer, ColdStartCosts, ColdStartPlan, allocate, shared_host_s


@dataclass(frozen=True)
class WakeChoice:
    whole: bool                    # wake the whole-model function; False: the stage functions
    plan: ColdStartPlan
    predicted: dict[int, float]    # each placeable size's predicted time to the first token, s
    reason: str


def choose(costs: ColdStartCosts, model_bytes: float, servers: list[ColdServer], stages: int,
           slo_ttft_s: float | None, slo_tpot_s: float | None = None, shared_cores: int | None = None,
           cpu_per_byte: float = 0.0) -> WakeChoice:
    """Algorithm 1 over sizes 1 and `stages`; without a TTFT objective every plan meets it, so
    the whole model (the fewest replicas) wakes. `shared_cores`: the cores
    the servers share, where they are emulated on one host (`cpu_per_byte`: CPU seconds a fetched
    byte costs there, where measured). ValueError where no server has a free slot for either."""
    full = [ColdServer(x.name, x.bandwidth, x.load_rate, x.fits_full, fits_part=False) for x in servers]
    ttft, tpot = slo_ttft_s or math.inf, slo_tpot_s or math.inf
    floor = None if shared_cores is None else \
        (lambda s: shared_host_s(costs, model_bytes, s, shared_cores, cpu_per_byte))
    plan = allocate(costs, model_bytes, full, ttft, tpot, sizes=(1, stages), floor_s=floor)
    predicted = {}
    for size in (1, stages):
        try:
            predicted[size] = allocate(costs, model_bytes, full, math.inf, math.inf, sizes=(size,), floor_s=floor).ttft_s
        except ValueError:
            continue  # fewer free servers than workers
    return WakeChoice(plan.size == 1, plan, predicted, _reason(plan, predicted, stages, ttft))


def _reason(plan: ColdStartPlan, predicted: dict[int, float], stages: int, slo_ttft_s: float) -> str:
    layout = "whole" if plan.size == 1 else f"as its {stages} stage functions"
    others = "; ".join(f"{'whole' if s == 1 else f'{s} stages'} {t:.1f} s" for s, t in predicted.items() if s != plan.size)
    if math.isinf(slo_ttft_s):
        verdict = "no TTFT objective"
    elif plan.ttft_s <= slo_ttft_s:
        verdict = f"within the {slo_ttft_s:g} s TTFT objective"
    else:
        verdict = f"no layout meets the {slo_ttft_s:g} s TTFT objective (HydraServe's fallback)"
    return (f"woken {layout} on {', '.join(plan.servers)}: predicted TTFT {plan.ttft_s:.1f} s, {verdict}"
            + (f" (else {others})" if others else " (the only layout with room)"))
