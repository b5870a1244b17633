"""How to start a model that has no replica (HydraServe §4.1, §5): predict the time to the first
token and the time per output token of each pipeline size s and placement, and choose (Algorithm 1).

A cold start at pipeline size s runs s workers, each fetching and loading 1/s of the model (M
bytes). A *full* worker has a whole server's compute for its part (on a GPU: the whole GPU's
memory; here: the cores a replica of the whole model would get), a *partial* one shares it with
others and computes at 1/s of the speed. Pure: measured costs and servers in, a choice out."""
from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

MAX_PIPELINE = 4  # HydraServe: larger sizes gain little


@dataclass(frozen=True)
class ColdStartCosts:
    """What earlier cold starts measured (HydraServe's t_c, t_n, t_p, t_d; Eq. 5's t_cc, t_cu, t_l)."""
    create_s: float          # t_cc: creating the process (or container) until its code runs
    libraries_s: float       # t_l: importing the serving libraries
    prefill_s: float         # t_p: the prompt's pass through the whole model on one full worker
    decode_s: float          # t_d: one token's pass through the whole model on one full worker
    hop_s: float             # t_n: handing activations to the next worker
    context_s: float = 0.0   # t_cu: a CUDA context (0 on the CPU)

    @property
    def runtime_s(self) -> float:
        """Eq. 1's t_c: everything before the parameters are fetched, when nothing overlaps."""
        return self.create_s + self.context_s + self.libraries_s


@dataclass(frozen=True)
class ColdServer:
    name: str
    bandwidth: float         # b: bytes/s it fetches from the model store at
    load_rate: float         # p: bytes/s it moves fetched parameters into the model at (PCIe; memory here)
    fits_full: bool = True   # room for a full worker
    fits_part: bool = True   # room for a partial one


@dataclass(frozen=True)
class ColdStartPlan:
    size: int                # s
    full: int                # w
    servers: tuple[str, ...]
    ttft_s: float
    tpot_s: float
    memory: float            # in units of the whole model: w + (s - w) / s


def compute_factor(size: int, full: int) -> float:
    """s - w + w / s: a pass over s workers, w of them full (Eq. 1, 2)."""
    return size - full + full / size


def ttft_sequential(costs: ColdStartCosts, model_bytes: float, servers: list[ColdServer], full: int) -> float:
    """Eq. 1: runtime, then fetch and load of M/s by the slowest worker, then the prefill."""
    s = len(servers)
    slowest = max(1 / x.bandwidth + 1 / x.load_rate for x in servers)
    return (costs.runtime_s + model_bytes / s * slowest + costs.prefill_s * compute_factor(s, full)
            + costs.hop_s * s)


def ttft_overlapped(costs: ColdStartCosts, model_bytes: float, servers: list[ColdServer], full: int) -> float:
    """Eq. 5: the fetch runs from placement on (prefetch) while the process starts, and loading
    overlaps the library imports."""
    s, part = len(servers), model_bytes / len(servers)
    start = costs.create_s + costs.context_s
    ready = max(max(start + max(part / x.load_rate, costs.libraries_s), part / x.bandwidth) for x in servers)
    return ready + costs.prefill_s * compute_factor(s, full) + costs.hop_s * s


def tpot(costs: ColdStartCosts, size: int, full: int) -> float:
    """Eq. 2."""
    return costs.decode_s * compute_factor(size, full) + costs.hop_s * size


def shared_host_s(costs: ColdStartCosts, model_bytes: float, size: int, cores: int, cpu_per_byte: float = 0.0) -> float:
    """The least time `size` workers emulated on one host of `cores` take to a first token: their
    imports, the fetched bytes' CPU and the prefill, spread over the cores."""
    return (size * costs.libraries_s + model_bytes * cpu_per_byte + costs.prefill_s) / cores


def allocate(costs: ColdStartCosts, model_bytes: float, servers: list[ColdServer], slo_ttft_s: float,
             slo_tpot_s: float, overlapped: bool = True, max_size: int = MAX_PIPELINE,
             sizes: Collection[int] | None = None, floor_s: Callable[[int], float] | None = None) -> ColdStartPlan:
    """Algorithm 1: every (s, w) with its best servers (full workers on the fastest servers that
    fit a whole model, partial ones on the fastest of the rest); of those meeting both SLOs the one
    using least memory, then the soonest first token; none meeting them: one full worker on the
    fastest server (HydraServe's fallback), or the soonest plan where no server fits a whole model.
    `sizes`: the pipeline sizes to consider (a model that declares its layouts), else 1..max_size;
    `floor_s(s)`: the least time s workers take (where they share one host's cores), if any."""
    def speed(x: ColdServer) -> float:
        return 1 / x.bandwidth + 1 / x.load_rate

    fulls = sorted((x for x in servers if x.fits_full), key=speed)
    plans = []
    for s in sorted(sizes) if sizes is not None else range(1, max_size + 1):
        for w in range(1 if s == 1 else 0, s + 1):  # one worker alone is a full one
            if w > len(fulls):
                break
            rest = sorted([x for x in servers if x.fits_part and x not in fulls[:w]], key=speed)
            chosen = fulls[:w] + rest[:s - w]
            if len(chosen) < s:
                continue
            ttft = (ttft_overlapped if overlapped else ttft_sequential)(costs, model_bytes, chosen, w)
            ttft = max(ttft, floor_s(s)) if floor_s else ttft
            plans.append(ColdStartPlan(s, w, tuple(x.name for x in chosen), ttft, tpot(costs, s, w),
                                       w + (s - w) / s))
    if not plans:
        raise ValueError("the servers have room for no plan of the sizes considered")
    meeting = [p for p in plans if p.ttft_s <= slo_ttft_s and p.tpot_s <= slo_tpot_s]
    if meeting:
        return min(meeting, key=lambda p: (p.memory, p.ttft_s))
    single = [p for p in plans if p.size == 1 and p.full == 1]
    return single[0] if single else min(plans, key=lambda p: p.ttft_s)


def fetch_deadline_s(slo_ttft_s: float | None, after_fetch_s: float, fallback_s: float, floor_s: float = 1.0) -> float:
    """How long a cold start's fetch may take, the deadline of the network-contention rule (Eq. 3):
    the model's TTFT SLO less what follows the fetch in Eq. 1 (loading, the prefill pass), as
    measured, never under `floor_s`; `fallback_s` for a model without a TTFT SLO. (Not the
    predicted TTFT itself: that assumes the whole link, so a deadline equal to it would refuse
    every second fetch on a server, and serialize a pipeline's cold start.)"""
    if slo_ttft_s is None:
        return fallback_s
    return max(floor_s, slo_ttft_s - after_fetch_s)


def stage_ranges(num_stages: int, size: int) -> list[tuple[int, int]]:
    """The model's stages split into `size` contiguous ranges, as even as they divide."""
    if not 1 <= size <= num_stages:
        raise ValueError(f"a pipeline of {size} workers over {num_stages} stages")
    bounds = [round(i * num_stages / size) for i in range(size + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(size)]
