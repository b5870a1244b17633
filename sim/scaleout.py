"""λScale's scale-out (§7.3–§7.5) in simulation: one LLM on up to N GPU servers joined by a fast
fabric, scaled out under bursts, under five systems that differ only in how a new server gets the
model and when it starts answering:

- `serverlessllm`: each new server loads the model from its own SSD (from host memory where it is
  still cached there) and answers once it holds all of it;
- `faasnet`: new servers receive it from a server that holds it in GPU memory over FaaSNet's binary
  tree (`scheduler.multicast.binary_tree_plan`), answering once whole;
- `multicast`: λScale's k-way binomial pipeline from every holder (`scheduler.multicast.plan`, the
  planner the live runtime uses), answering once whole: the multicast without execute-while-load,
  what NCCL's broadcast gives without its group set-up;
- `lambdascale`: the same multicast with execute-while-load: the new servers form execution
  pipelines by Algorithm 2 (`scheduler.multicast.execution_pipelines`) that answer as soon as their
  members together hold every block, and switch to local execution (each request's KV cache
  recomputed on the member it moves to, as λScale §4.4 does) once every member holds the model;
- `ideal`: a new server answers the moment it is asked for (λScale's "Ideal Scaling").

Where no server holds the model in GPU memory, every system reads it from SSD or host memory.

Modelled, not measured (λScale publishes no per-token figures): an H800's decode step reads the
weights once at half its 3.35 TB/s (TPOT = bytes / 1.675 TB/s, flat in the batch, as memory-bound
decoding is), a prefill runs 2·params·tokens at half its 990 dense BF16 TFLOP/s, a request's pass
crosses a pipeline's servers at `hop_s` each, and an execution pipeline of L servers keeps L
batches in flight (λScale Fig. 6a), so it has L servers' slots at one full pass per token. A link
moves one block a round at its full rate (`MulticastPlan.seconds`); a server in a pipeline starts
local execution when the pipeline's last member is whole, not before; Llama-2 70B runs on a server
of 4 GPUs as one instance (tensor parallel, its weights read 4 ways). One autoscaling rule for
every system (`servers_wanted`), looked at every `tick_s`: as many servers as the requests in the
system need slots, never fewer than `min_servers` (λScale keeps a replica so that k ≥ 1), a server given back after
`keep_alive_s` idle; its host memory keeps the model `host_keep_s` more (λScale Fig. 2: 95 % of
models leave host memory within 15 s)."""
from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from loadgen.arrivals import bursty_arrivals
from scheduler.multicast import binary_tree_plan, execution_pipelines, plan, pulls_by_target

GB = 1e9
HBM_BYTES_S = 3.35e12 * 0.5      # an H800's HBM at half its peak
FLOPS = 990e12 * 0.5             # its dense BF16 at half its peak


@dataclass(frozen=True)
class Llm:
    name: str
    params: float
    bytes: float
    gpus: int = 1

    @property
    def tpot_s(self) -> float:
        return self.bytes / (HBM_BYTES_S * self.gpus)

    def prefill_s(self, tokens: int) -> float:
        return 2 * self.params * tokens / (FLOPS * self.gpus)


MODELS = {m.name: m for m in (Llm("llama2-7b", 6.7e9, 13.5 * GB), Llm("llama2-13b", 13.0e9, 26.0 * GB),
                              Llm("llama2-70b", 69.0e9, 138.0 * GB, gpus=4))}


@dataclass(frozen=True)
class Fabric:
    """λScale's testbed 1 (Table 1): 12 servers, 400 Gb/s InfiniBand, SSD 5 GB/s, host memory to
    GPU 64 GB/s; b = 16 blocks (its §7.6 best count)."""
    servers: int = 12
    link_bytes_s: float = 400e9 / 8
    ssd_bytes_s: float = 5e9
    host_bytes_s: float = 64e9
    blocks: int = 16
    hop_s: float = 0.0005
    batch: int = 32
    min_servers: int = 1
    tick_s: float = 1.0
    keep_alive_s: float = 10.0
    host_keep_s: float = 15.0


@dataclass(frozen=True)
class System:
    name: str
    transfer: str                    # binomial | binary_tree | none (from SSD or host memory) | instant
    execute_while_load: bool = False


SYSTEMS = {s.name: s for s in (System("serverlessllm", "none"), System("faasnet", "binary_tree"),
                                System("multicast", "binomial"), System("lambdascale", "binomial", True),
                                System("ideal", "instant"))}


@dataclass(frozen=True)
class Start:
    """One scale-out round, relative to its start: when each target holds the whole model, and
    the execution pipelines (members, when they first answer) that answer before that."""
    whole: dict[int, float]
    pipelines: tuple[tuple[tuple[int, ...], float], ...] = ()


def start_plan(system: System, fabric: Fabric, model: Llm, holders: list[int], targets: list[int],
               cached: set[int]) -> Start:
    """How `targets` get the model: from host memory where `cached`, else from the `holders` over
    the system's multicast, else from SSD. Pure."""
    if system.transfer == "instant":
        return Start({t: 0.0 for t in targets})
    whole = {t: model.bytes / fabric.host_bytes_s for t in targets if t in cached}
    rest = [t for t in targets if t not in cached]
    if not holders or system.transfer == "none":
        return Start({**whole, **{t: model.bytes / fabric.ssd_bytes_s for t in rest}})
    if not rest:
        return Start(whole)
    names = {str(s): s for s in holders + rest}
    if system.transfer == "binary_tree":
        p = binary_tree_plan(str(holders[0]), [str(t) for t in rest], fabric.blocks)
    else:
        p = plan([str(h) for h in holders[:len(rest)]], [str(t) for t in rest], fabric.blocks)
    round_s = model.bytes / fabric.blocks / fabric.link_bytes_s
    # each target's blocks by the round (1-based) at whose end it holds them
    arrived = {t: {step.block: step.round + 1 for step in steps} for t, steps in pulls_by_target(p).items()}
    whole.update({names[t]: max(r.values()) * round_s for t, r in arrived.items()})
    if not system.execute_while_load:
        return Start(whole)
    pipelines = []
    for members in execution_pipelines([g[1:] for g in p.groups]):
        answers = max(min(arrived[m][b] for m in members) for b in range(p.blocks)) * round_s
        servers = tuple(names[m] for m in members)
        if len(servers) > 1 and answers < max(whole[s] for s in servers):
            pipelines.append((servers, answers))
    return Start(whole, tuple(pipelines))


def servers_wanted(requests: int, batch: int, most: int, least: int) -> int:
    """The autoscaling rule every system shares: a slot per request in the system. Pure."""
    return max(least, min(most, math.ceil(requests / batch)))


@dataclass(eq=False)
class Instance:
    servers: tuple[int, ...]
    slots: int
    tpot_s: float
    until: float = math.inf           # a pipeline's switch to local execution
    running: list = field(default_factory=list)
    idle_since: float = 0.0

    @property
    def hops(self) -> int:
        return len(self.servers)


@dataclass(eq=False)
class Job:
    at: float
    prompt: int
    tokens: int
    first: float = math.nan
    made: int = 0                     # tokens made before its current run
    run: tuple[float, float] = (0.0, 0.0)   # current run: (its first token, its last)
    on: Instance | None = None
    version: int = 0


@dataclass
class Result:
    ttft: list[float]
    done: list[float]
    runs: list[tuple[float, float, int]]     # (first token, last, tokens) of every run
    capacity: list[tuple[float, int]]        # (time, slots answering) at every change
    gpu_seconds: float
    starts: dict[str, int]

    def throughput(self, until: float, step: float) -> np.ndarray:
        """Tokens per second in bins of `step` from 0 to `until`, each token spread over the
        interval from it to the next (so a run's rate is its TPOT's)."""
        bins = np.zeros(max(1, math.ceil(until / step)))
        for first, last, tokens in self.runs:
            if tokens <= 0:
                continue
            if last <= first:
                bins[min(int(first / step), len(bins) - 1)] += tokens
                continue
            last = first + (last - first) * tokens / (tokens - 1)
            edges = np.arange(int(first / step), min(len(bins), int(last / step) + 1))
            overlap = np.minimum((edges + 1) * step, last) - np.maximum(edges * step, first)
            bins[edges] += tokens * overlap / (last - first)
        return bins / step

    def capacity_at(self, slots: int) -> float:
        """The first time at least `slots` slots answered (inf if never)."""
        return next((t for t, s in self.capacity if s >= slots), math.inf)


class ScaleOut:
    """One system serving one model's requests on the fabric's servers."""

    def __init__(self, system: System, model: Llm, fabric: Fabric, warm: int = 1) -> None:
        self.system, self.model, self.fabric = system, model, fabric
        self.events: list = []
        self.order = itertools.count()
        self.queue: deque[Job] = deque()
        self.instances: list[Instance] = []
        self.left = 0                                   # jobs not yet done
        self.serving: dict[int, Instance] = {}          # a server's local instance
        self.since: dict[int, float] = {}               # when each server in use took its GPU
        self.cached_until: dict[int, float] = {}
        self.result = Result([], [], [], [(0.0, 0)], 0.0, {"local": 0, "pipeline": 0})
        self.clock = 0.0
        for s in range(warm):
            self.since[s] = 0.0
            self._add(0.0, self._local(s))

    def at(self, t: float, kind: str, *args) -> None:
        heapq.heappush(self.events, (t, next(self.order), kind, args))

    def run(self, jobs: list[Job], scale_to: int = 0) -> Result:
        """Serves `jobs`; `scale_to` > 0 starts that many servers at once at time 0 (λScale's
        1 → N experiments) instead of the autoscaling rule."""
        self.left = len(jobs)
        if scale_to:
            self._scale_out(0.0, scale_to - len(self.since))
        else:
            self.at(0.0, "tick")
        for job in jobs:
            self.at(job.at, "arrive", job)
        while self.events:
            now, _, kind, args = heapq.heappop(self.events)
            getattr(self, "_" + kind)(now, *args)
        self.result.gpu_seconds += self.model.gpus * sum(self.clock - since for since in self.since.values())
        return self.result

    # -- requests ------------------------------------------------------------------------------

    def _arrive(self, now: float, job: Job) -> None:
        self.clock = now
        self.queue.append(job)
        self._dispatch(now)

    def _dispatch(self, now: float) -> None:
        while self.queue:
            free = [i for i in self.instances if len(i.running) < i.slots and now < i.until]
            if not free:
                return
            # Local execution first; among equals the fullest, so that what a burst left idle
            # drains and is given back.
            best = min(free, key=lambda i: (i.tpot_s, -len(i.running)))
            self._place(now, self.queue.popleft(), best)

    def _place(self, now: float, job: Job, inst: Instance) -> None:
        """Runs `job` on `inst` from its `made` tokens: a prefill over the prompt and those tokens
        (a recomputation after a switch) gives the next token, then one a TPOT."""
        first = now + self.model.prefill_s(job.prompt + job.made) + inst.hops * self.fabric.hop_s
        if job.made == 0:
            job.first = first
        job.on, job.version, job.run = inst, job.version + 1, (first, first + (job.tokens - job.made - 1) * inst.tpot_s)
        inst.running.append(job)
        self.at(job.run[1], "finish", job, job.version)

    def _finish(self, now: float, job: Job, version: int) -> None:
        if version != job.version:
            return
        self.clock = now
        inst = job.on
        inst.running.remove(job)
        self.result.runs.append((job.run[0], now, job.tokens - job.made))
        self._done(now, job)
        self._maybe_idle(now, inst)
        self._dispatch(now)

    def _done(self, now: float, job: Job) -> None:
        self.left -= 1
        self.result.done.append(now)
        self.result.ttft.append(job.first - job.at)

    # -- servers -------------------------------------------------------------------------------

    def _local(self, s: int) -> Instance:
        return Instance((s,), self.fabric.batch, self.model.tpot_s)

    def _add(self, now: float, inst: Instance) -> None:
        self.instances.append(inst)
        if inst.until == math.inf:
            self.serving[inst.servers[0]] = inst
        self._capacity(now)

    def _capacity(self, now: float) -> None:
        slots = sum(i.slots for i in self.instances if now < i.until)
        if slots != self.result.capacity[-1][1]:
            self.result.capacity.append((now, slots))

    def _tick(self, now: float) -> None:
        """The autoscaler's periodic look (every `tick_s`, as Knative's): servers for what the
        requests in the system need, started in one scale-out."""
        demand = len(self.queue) + sum(len(i.running) for i in self.instances)
        want = servers_wanted(demand, self.fabric.batch, self.fabric.servers, self.fabric.min_servers)
        if want > len(self.since):
            self._scale_out(now, want - len(self.since))
        if self.left:
            self.at(now + self.fabric.tick_s, "tick")

    def _scale_out(self, now: float, count: int) -> None:
        free = [s for s in range(self.fabric.servers) if s not in self.since]
        free.sort(key=lambda s: (self.cached_until.get(s, -1.0) < now, s))
        targets = free[:count]
        if not targets:
            return
        cached = {s for s in targets if self.cached_until.get(s, -1.0) >= now}
        holders = sorted(self.serving)
        start = start_plan(self.system, self.fabric, self.model, holders, targets, cached)
        piped = {s for members, _ in start.pipelines for s in members}
        for s in targets:
            self.since[s] = now
            if s not in piped:
                self.at(now + start.whole[s], "ready", self._local(s))
                self.result.starts["local"] += 1
        for members, answers in start.pipelines:
            until = now + max(start.whole[s] for s in members)
            pipe = Instance(members, len(members) * self.fabric.batch,
                            self.model.tpot_s + len(members) * self.fabric.hop_s, until)
            self.at(now + answers, "ready", pipe)
            self.at(until, "switch", pipe)
            self.result.starts["pipeline"] += 1

    def _ready(self, now: float, inst: Instance) -> None:
        self.clock = now
        self._add(now, inst)
        self._maybe_idle(now, inst)
        self._dispatch(now)

    def _switch(self, now: float, pipe: Instance) -> None:
        """Every member holds the model: each answers alone, and the pipeline's requests are spread
        over them, each recomputing its KV cache from the tokens it has (λScale §4.4)."""
        self.clock = now
        self.instances.remove(pipe)
        locals_ = [self._local(s) for s in pipe.servers]
        for inst in locals_:
            self._add(now, inst)
        for index, job in enumerate(pipe.running):
            first, _ = job.run
            made = 0 if now < first else min(job.tokens - job.made, int((now - first) / pipe.tpot_s) + 1)
            if made:
                self.result.runs.append((first, now, made))
            job.made += made
            if job.made == job.tokens:  # its last token came at the switch
                job.version += 1
                self._done(now, job)
                continue
            self._place(now, job, locals_[index % len(locals_)])
        for inst in locals_:
            self._maybe_idle(now, inst)
        self._dispatch(now)

    def _maybe_idle(self, now: float, inst: Instance) -> None:
        """A local instance with nothing to do is given back after the keep-alive, unless work
        comes first."""
        if not inst.running and inst.until == math.inf:
            inst.idle_since = now
            self.at(now + self.fabric.keep_alive_s, "expire", inst)

    def _expire(self, now: float, inst: Instance) -> None:
        s = inst.servers[0]
        if (inst.running or self.serving.get(s) is not inst or now - inst.idle_since < self.fabric.keep_alive_s - 1e-9
                or len(self.since) <= self.fabric.min_servers):
            return
        self.clock = now
        self.instances.remove(inst)
        del self.serving[s]
        self.result.gpu_seconds += self.model.gpus * (now - self.since.pop(s))
        self.cached_until[s] = now + self.fabric.host_keep_s
        self._capacity(now)


def jobs_at(times: np.ndarray, seed: int, prompt_mean: int = 600, output_mean: int = 250) -> list[Job]:
    """Requests at `times` with heavy-tailed (log-normal) prompt and output lengths of the given
    means, BurstGPT's shape (not a fit to it): between 16 and 8× the mean tokens."""
    rng = np.random.default_rng(seed + 1)
    sigma = 0.8
    def lengths(mean: int) -> np.ndarray:
        drawn = rng.lognormal(math.log(mean) - sigma ** 2 / 2, sigma, len(times))
        return np.clip(drawn, 16, 8 * mean).astype(int)
    return [Job(float(t), int(p), int(o)) for t, p, o in zip(times, lengths(prompt_mean), lengths(output_mean))]


def burst(count: int, prompt: int = 512, tokens: int = 128) -> list[Job]:
    """`count` requests at once (λScale §7.3–7.4's stress and burst tests)."""
    return [Job(0.0, prompt, tokens) for _ in range(count)]


def burstgpt_like(rate: float, duration_s: float, seed: int) -> list[Job]:
    """BurstGPT-shaped arrivals (`loadgen.arrivals.bursty_arrivals`) with its heavy-tailed lengths."""
    return jobs_at(bursty_arrivals(rate, duration_s, seed), seed)


def simulate(system: str | System, model: str | Llm, jobs: list[Job], fabric: Fabric | None = None,
             warm: int = 1, scale_to: int = 0) -> Result:
    """One system on `jobs` (fresh copies are served; the given ones are left as they are)."""
    fabric = fabric or Fabric()
    sim = ScaleOut(SYSTEMS[system] if isinstance(system, str) else system,
                   MODELS[model] if isinstance(model, str) else model, fabric, warm)
    return sim.run([Job(j.at, j.prompt, j.tokens) for j in jobs], scale_to=scale_to)
