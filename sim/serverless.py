"""HydraServe's end-to-end experiment (§8.3) in simulation: many long-tail LLMs on a GPU cluster,
every one scaled from zero by its requests, and the time to first token (TTFT) that their cold
starts give under four systems:

- `serverless-vllm`: a whole-model worker, started step after step (container, CUDA, libraries,
  then fetch, then load: HydraServe's Eq. 1 at s = 1);
- `serverlessllm`: the same, with every server's host memory a cache of models (least recently
  used goes first) loaded at ServerlessLLM's speed (its 0.68 s for an 8 B model from SSD as the
  anchor), and placement on a server that caches the model where one has a free GPU;
- `quart-sequential`: this project before HydraServe's mechanisms: the model's 4 stage functions
  cold-start as 4 workers on 4 servers, each sharing its GPU with others (QUART co-locates stage
  replicas) and fetching its quarter after its libraries (Eq. 1 at s = 4), and stay so while they
  live;
- `hydraserve`: this project with them: Algorithm 1 chooses the pipeline size and the servers
  (each server's fetch bandwidth shared with the fetches under way there), prefetch and overlap
  (Eq. 5), then consolidation: one worker fetches the rest of the model and the others give their
  GPUs back.

Workload (HydraServe §8.3): 64 models per application (chatbot, code completion, summarization),
Llama2-7B and 13B alternately, warm TTFT and TPOT from HydraServe's Table 2, TTFT SLO 5x the warm
TTFT (10x for summarization), TPOT SLO 2x the warm TPOT (reading speed, 200 ms, for chatbot): Table 3's
SLOs; requests a Gamma process of the given rate and CV, each
going to a model drawn by a heavy-tailed (log-normal) popularity, as the Azure Functions trace's
invocations are spread. Simplifications, said here: a fetch's share of its server's
bandwidth is fixed when it starts (the fetches under way then, HydraServe Eq. 4's estimate); a GPU's
memory is counted in quarters (a full worker takes the GPU, a partial one the quarters its part
needs) and a pipeline's prefill costs HydraServe's compute factor (s - w + w/s), as if every GPU
it shares were busy; a worker serves 8 requests at once (HydraServe's batch); one pass per request
(prefill, then its output tokens at the TPOT); consolidation needs room on the kept worker's GPU."""
from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

from loadgen.arrivals import gamma_arrivals
from scheduler.coldstart import MAX_PIPELINE, ColdServer, ColdStartCosts, allocate, compute_factor, ttft_overlapped, ttft_sequential

GB = 1e9
BATCH = 8


@dataclass(frozen=True)
class GpuServer:
    name: str
    gpus: int
    gpu_bytes: float
    host_bytes: float
    bandwidth: float       # bytes/s from the model store
    load_rate: float       # bytes/s host to GPU


def testbed() -> list[GpuServer]:
    """HydraServe's testbed (i): 4 A10 servers (one 24 GB GPU, 188 GB memory) and 4 V100 servers
    (four 32 GB GPUs, 368 GB), 16 Gb/s each to the model store; PCIe 3 at about 12 GB/s."""
    return ([GpuServer(f"a10-{i}", 1, 24 * GB, 188 * GB, 2 * GB, 12 * GB) for i in range(4)]
            + [GpuServer(f"v100-{i}", 4, 32 * GB, 368 * GB, 2 * GB, 12 * GB) for i in range(4)])


@dataclass(frozen=True)
class LlmModel:
    name: str
    app: str
    bytes: float
    prefill_s: float
    tpot_s: float
    output_tokens: int
    slo_ttft_s: float
    slo_tpot_s: float


# HydraServe Table 2: warm TTFT and TPOT (1024 input tokens, batch 8) of Llama2-7B on an A10 and
# Llama2-13B on a V100. Its sizes (12.5 and 24.2) are GiB; these are the same FP16 weights in GB.
WARM = ((13.5 * GB, 1.5, 0.042), (26.0 * GB, 2.4, 0.058))
# Table 3's SLOs as §8.3 derives them from Table 2: TTFT 5x the warm TTFT (10x for summarization);
# TPOT 2x the warm TPOT, but reading speed (300 words a minute: 200 ms) for chatbot; and output
# lengths typical of each dataset (ShareGPT, HumanEval, LongBench).
APPS = {"chatbot": (5, 0.200, 256), "code": (5, None, 96), "summarization": (10, None, 192)}
TPOT_SLO_FACTOR = 2


def models(per_app: int = 64) -> list[LlmModel]:
    """`per_app` models per application, Llama2-7B and 13B alternately (7B first)."""
    out = []
    for app, (ttft_factor, reading_tpot, tokens) in APPS.items():
        for i in range(per_app):
            size, ttft, tpot = WARM[i % 2]
            out.append(LlmModel(f"{app}-{i}", app, size, ttft, tpot, tokens, ttft_factor * ttft,
                                reading_tpot or TPOT_SLO_FACTOR * tpot))
    return out


@dataclass(frozen=True)
class System:
    name: str
    size: int = 1                    # pipeline size; 0: Algorithm 1 chooses
    overlapped: bool = False         # prefetch and overlap (Eq. 5) instead of Eq. 1
    consolidate: bool = False
    cache_load_rate: float = 0.0     # > 0: models cached in host memory, loaded at this rate


SYSTEMS = {s.name: s for s in (
    System("serverless-vllm"),
    System("serverlessllm", cache_load_rate=16 * GB / 0.68),
    System("quart-sequential", size=4),
    System("hydraserve", size=0, overlapped=True, consolidate=True))}
# A container, a CUDA context and vLLM's libraries (HydraServe §2's breakdown, rounded).
RUNTIME = dict(create_s=2.0, context_s=2.0, libraries_s=6.0, hop_s=0.01)


@dataclass(frozen=True)
class Workload:
    rps: float = 0.6
    cv: float = 8.0
    duration_s: float = 3600.0
    popularity_sigma: float = 2.0
    keep_alive_s: float = 30.0
    slo_scale: float = 1.0
    seed: int = 0


def arrivals(w: Workload, ms: list[LlmModel]) -> list[tuple[float, int]]:
    """(time, model index) of every request, in time order: a Gamma process of `rps` and `cv`,
    each request going to a model drawn by its popularity."""
    rng = np.random.default_rng(w.seed)
    weights = rng.lognormal(0.0, w.popularity_sigma, len(ms))
    times = gamma_arrivals(w.rps, w.cv, w.duration_s, w.seed)
    chosen = rng.choice(len(ms), size=len(times), p=weights / weights.sum())
    return [(float(t), int(m)) for t, m in zip(times, chosen)]


# A GPU's memory in quarters: a full worker takes all four, a partial one (1/s of the model, with
# others on its GPU) as many as its part needs.
QUARTERS = 4


@dataclass(frozen=True)
class Slot:
    server: int
    gpu: int
    quarters: int


@dataclass(eq=False)
class Worker:
    model: int
    slots: list[Slot]                 # one per pipeline worker
    started: float
    ready_at: float
    factor: float                     # prefill cost as a multiple of a full worker's
    hops: int                         # hand-offs per pass (Eq. 1 counts one per worker)
    busy: int = 0
    idle_since: float = 0.0


@dataclass
class Result:
    ttft: list[float] = field(default_factory=list)
    slo: list[float] = field(default_factory=list)
    cold_starts: int = 0
    pipelined: int = 0                # cold starts of more than one worker
    consolidated: int = 0
    gpu_seconds: float = 0.0          # GPU memory held over time, in whole GPUs

    def attainment(self, scale: float = 1.0) -> float:
        return float(np.mean([t <= s * scale for t, s in zip(self.ttft, self.slo)])) if self.ttft else 1.0


class Cluster:
    """One run: the events of every request and worker of one system."""

    def __init__(self, system: System, servers: list[GpuServer], ms: list[LlmModel], w: Workload) -> None:
        self.system, self.servers, self.models, self.w = system, servers, ms, w
        self.free = [[QUARTERS] * s.gpus for s in servers]   # free quarters per GPU
        self.fetches: list[list[float]] = [[] for _ in servers]       # end times of fetches under way
        self.cache: list[OrderedDict] = [OrderedDict() for _ in servers]
        self.workers: list[list[Worker]] = [[] for _ in ms]
        self.queue: list[deque] = [deque() for _ in ms]
        self.events: list = []
        self.order = itertools.count()
        self.clock = 0.0
        self.result = Result()

    def at(self, t: float, kind: str, *args) -> None:
        heapq.heappush(self.events, (t, next(self.order), kind, args))

    def run(self, requests: list[tuple[float, int]]) -> Result:
        for t, m in requests:
            self.at(t, "arrive", m)
        while self.events:
            now, _, kind, args = heapq.heappop(self.events)
            self.clock = now
            getattr(self, "_" + kind)(now, *args)
        return self.result

    # -- requests ------------------------------------------------------------------------------

    def _arrive(self, now: float, m: int) -> None:
        self.queue[m].append(now)
        self._serve(now, m)

    def _serve(self, now: float, m: int) -> None:
        """Requests to workers with room; a cold start for what the starting workers cannot take."""
        model = self.models[m]
        for wk in self.workers[m]:
            while self.queue[m] and wk.ready_at <= now and wk.busy < BATCH:
                arrived = self.queue[m].popleft()
                first = now + model.prefill_s * wk.factor + RUNTIME["hop_s"] * wk.hops
                self.result.ttft.append(first - arrived)
                self.result.slo.append(model.slo_ttft_s * self.w.slo_scale)
                wk.busy += 1
                self.at(first + model.tpot_s * (model.output_tokens - 1), "done", wk)
        while len(self.queue[m]) > sum(BATCH for wk in self.workers[m] if wk.ready_at > now):
            if not self._cold_start(now, m):
                break  # no GPU free: it waits for one

    def _done(self, now: float, wk: Worker) -> None:
        wk.busy -= 1
        if wk.busy == 0:
            wk.idle_since = now
            self.at(now + self.w.keep_alive_s, "expire", wk)
        self._serve(now, wk.model)

    def _expire(self, now: float, wk: Worker) -> None:
        if wk.busy == 0 and wk in self.workers[wk.model] and now - wk.idle_since >= self.w.keep_alive_s - 1e-9:
            self.workers[wk.model].remove(wk)
            self._release(now, wk.slots, wk.started)

    def _release(self, now: float, slots: list[Slot], since: float) -> None:
        for slot in slots:
            self.result.gpu_seconds += slot.quarters / QUARTERS * (now - since)
            self.free[slot.server][slot.gpu] += slot.quarters
        for m in range(len(self.models)):  # GPUs came free: queued models may start
            if self.queue[m]:
                self._serve(now, m)

    def _ready(self, now: float, m: int) -> None:
        self._serve(now, m)

    def _consolidated(self, now: float, wk: Worker) -> None:
        """The first worker has fetched the whole model: it takes its whole GPU (where the others
        on it leave room; else the group stays as it is) and the other workers go."""
        keep = wk.slots[0]
        grow = QUARTERS - keep.quarters
        if wk not in self.workers[wk.model] or self.free[keep.server][keep.gpu] < grow:
            return
        self.free[keep.server][keep.gpu] -= grow
        since, gone = wk.started, wk.slots[1:]
        self.result.gpu_seconds += keep.quarters / QUARTERS * (now - since)
        wk.slots, wk.factor, wk.hops, wk.started = [Slot(keep.server, keep.gpu, QUARTERS)], 1.0, 1, now
        self.result.consolidated += 1
        self._release(now, gone, since)

    # -- cold starts ---------------------------------------------------------------------------

    def _share(self, s: int, now: float) -> float:
        self.fetches[s] = [t for t in self.fetches[s] if t > now]
        return self.servers[s].bandwidth / (len(self.fetches[s]) + 1)

    def _gpu(self, s: int, quarters: int) -> int | None:
        """The GPU of server s with room for `quarters` and the least room left (best fit)."""
        room = [(q, g) for g, q in enumerate(self.free[s]) if q >= quarters]
        return min(room)[1] if room else None

    def _quarters(self, model: LlmModel, size: int, full: bool, s: int) -> int:
        if full:
            return QUARTERS
        part = model.bytes / size * 1.1  # parameters and working memory
        return max(1, math.ceil(QUARTERS * part / self.servers[s].gpu_bytes))

    def _cold_start(self, now: float, m: int) -> bool:
        """Starts a worker for model m where GPUs have room; False where none can start now."""
        model = self.models[m]
        costs = ColdStartCosts(prefill_s=model.prefill_s, decode_s=model.tpot_s, **RUNTIME)
        size = self.system.size
        whole = [s for s in range(len(self.servers)) if self.servers[s].gpu_bytes >= model.bytes * 1.1]
        cold = [ColdServer(str(s), self._share(s, now), self.servers[s].load_rate,
                           s in whole and self._gpu(s, QUARTERS) is not None,
                           self._gpu(s, self._quarters(model, size or MAX_PIPELINE, False, s)) is not None)
                for s in range(len(self.servers))]
        if size == 0:
            try:
                plan = allocate(costs, model.bytes, [c for c in cold if c.fits_full or c.fits_part],
                                model.slo_ttft_s * self.w.slo_scale, model.slo_tpot_s)
            except ValueError:
                return False
            chosen, full = [int(x) for x in plan.servers], plan.full
        else:
            pool = [s for s in range(len(self.servers)) if (cold[s].fits_full if size == 1 else cold[s].fits_part)]
            pool.sort(key=lambda s: (model.name not in self.cache[s], len(self.fetches[s]), s))
            if len(pool) < size:
                return False
            chosen, full = pool[:size], 1 if size == 1 else 0
        slots = []
        for i, s in enumerate(chosen):
            quarters = self._quarters(model, len(chosen), i < full, s)
            gpu = self._gpu(s, quarters)
            if gpu is None:  # the plan's part is larger than the smallest one checked
                return False
            slots.append(Slot(s, gpu, quarters))
        for slot in slots:
            self.free[slot.server][slot.gpu] -= slot.quarters
        servers = [cold[s] for s in chosen]
        if self.system.cache_load_rate > 0 and model.name in self.cache[chosen[0]]:
            ready = now + costs.runtime_s + model.bytes / self.system.cache_load_rate
        else:
            predict = ttft_overlapped if self.system.overlapped else ttft_sequential
            pass_s = costs.prefill_s * compute_factor(len(chosen), full) + costs.hop_s * len(chosen)
            ready = now + predict(costs, model.bytes, servers, full) - pass_s
            if self.system.cache_load_rate > 0:  # ServerlessLLM loads at its own speed
                ready += model.bytes * (1 / self.system.cache_load_rate - 1 / servers[0].load_rate)
            for s, srv in zip(chosen, servers):
                self.fetches[s].append(now + model.bytes / len(chosen) / srv.bandwidth)
        if self.system.cache_load_rate > 0:
            self._cache(chosen[0], model)
        wk = Worker(m, slots, now, ready, compute_factor(len(chosen), full), len(chosen))
        self.workers[m].append(wk)
        self.result.cold_starts += 1
        self.result.pipelined += len(chosen) > 1
        self.at(ready, "ready", m)
        if self.system.consolidate and len(chosen) > 1:
            rest = model.bytes * (1 - 1 / len(chosen))
            self.at(ready + rest / servers[0].bandwidth + rest / servers[0].load_rate, "consolidated", wk)
        return True

    def _cache(self, s: int, model: LlmModel) -> None:
        cache = self.cache[s]
        cache[model.name] = model.bytes
        cache.move_to_end(model.name)
        while sum(cache.values()) > self.servers[s].host_bytes * 0.85:
            cache.popitem(last=False)


def simulate(system: str | System, w: Workload, servers: list[GpuServer] | None = None,
             ms: list[LlmModel] | None = None, requests: list[tuple[float, int]] | None = None) -> Result:
    """One system on one workload (or on the given `requests`: (time, model index))."""
    ms = models() if ms is None else ms
    servers = testbed() if servers is None else servers
    cluster = Cluster(SYSTEMS[system] if isinstance(system, str) else system, servers, ms, w)
    return cluster.run(arrivals(w, ms) if requests is None else requests)


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.inf
