"""The discrete-event core: requests arrive at a model's entry, visit its stages through one
shared FCFS queue per stage, and come back (a generative model's requests then decode token by
token through the replicas holding their caches: sim.generation); every tick the configured policy decides on what it
observed with the live control loop's own step (autoscaler.policy.controller: the policies, the
bounds, the key stages), and the cluster carries the actions out through the placement scheduler."""
from __future__ import annotations

import heapq
import itertools
import logging
import math
from dataclasses import dataclass, field

import numpy as np

from autoscaler.policy.arbitration import ModelRules
from autoscaler.policy.controller import Controller, enact
from autoscaler.policy.idle import ModelActivity
from autoscaler.policy.layout import ArrivalWindows, LayoutRule, LayoutState
from autoscaler.policy.state import PipelineState
from contracts import artefacts
from contracts.config import Settings, load_settings
from contracts.stage import StageRef
from frontend.admission import Admission
from loadgen.client import Record
from scheduler.placement import Scheduler, SchedulerParams
from sim.cluster import Hop, RequestWork, SimCluster
from sim.config import SimConfig
from sim.generation import EVENTS, GenerationPlane, Outcome
from sim.models import GenerativeModel, SimModel
from sim.stage import SimReplica, Stage
from sim.unloaded import unloaded_latency

TIMEOUT_STATUS = 504
_ERRORS = {504: "timed out in the simulated pipeline", 429: "refused: overloaded or no KV room in time (429)",
           413: "the request's KV cache exceeds a replica's budget (413)"}
log = logging.getLogger("quart.sim")


@dataclass
class Trace:
    """What one run produced: per request its model, times and outcome, per stage the wait and
    service of every request (seconds; NaN where it never got there), and the samples."""
    models: list[str]
    model_of: np.ndarray           # index into models
    sent: np.ndarray
    latency: np.ndarray            # NaN: no answer
    status: np.ndarray
    wait: np.ndarray               # [request, stage]
    service: np.ndarray
    stage_arrivals: dict[str, list[np.ndarray]]
    samples: dict[str, dict]       # model -> {"t", "replicas", "queue"}
    decisions: int = 0
    starts: dict[str, int] = field(default_factory=dict)
    events: int = 0
    end: float = 0.0
    generation: Outcome | None = None   # TTFT, TPOT, tokens and batches of generative models

    def records(self, detail: bool = True) -> list[Record]:
        """The load generator's records, so its metrics and report take simulated runs."""
        out = []
        g = self.generation
        for i in range(len(self.sent)):
            model = self.models[self.model_of[i]]
            stages = [{"stage": k, "queue_ms": round(float(self.wait[i, k]) * 1000, 3),
                       "service_ms": round(float(self.service[i, k]) * 1000, 3)}
                      for k in range(self.wait.shape[1]) if not math.isnan(self.wait[i, k])] if detail else []
            ok = self.status[i] == 200
            record = Record(i, model, float(self.sent[i]), float(self.sent[i]),
                            float(self.latency[i]) if not math.isnan(self.latency[i]) else -1.0,
                            int(self.status[i]), stages=stages, error="" if ok else _ERRORS.get(int(self.status[i]), ""))
            if g is not None and g.prompt[i]:
                record.prompt_tokens, record.output_tokens = int(g.prompt[i]), int(g.tokens[i])
                if ok:
                    record.ttft_s, record.tpot_s = float(g.ttft[i]), float(g.tpot[i])
            out.append(record)
        return out


class Simulation:
    def __init__(self, cfg: SimConfig, models: list[SimModel | GenerativeModel], arrivals: dict[str, np.ndarray],
                 policy: str = "quart", settings: Settings | None = None,
                 scheduler: Scheduler | None = None, record_arrivals: bool = True,
                 prompts: dict[str, np.ndarray] | None = None) -> None:
        """`prompts`: a generative model's prompt lengths in its requests' order (default: drawn
        from its calibration's ShareGPT sample)."""
        self.cfg, self.models = cfg, models
        self.settings = (settings or load_settings(environ={})).replace(policy=policy, tick_s=cfg.tick_s,
                                                          window_s=cfg.window_s, slo_s=cfg.slo_s)
        self._heap: list = []
        self._seq = itertools.count()
        self.now = 0.0
        self.events = 0
        self._cpu_seen = (0.0, 0.0)     # (when, core-seconds used by then), for _idle_cores
        rng_root = np.random.SeedSequence(cfg.seed)
        self.chains: dict[str, list[Stage]] = {}
        self.hop: dict[str, float] = {}
        self.prompt_rngs: dict[str, np.random.Generator] = {}
        wholes = []
        for m, child in zip(models, rng_root.spawn(len(models))):
            chain = [self._stage(m, i, np.random.default_rng(g)) for i, g in enumerate(child.spawn(m.num_stages))]
            self.prompt_rngs[m.name] = np.random.default_rng(child.spawn(1)[0])
            if cfg.whole_max > 0 and isinstance(m, SimModel):
                wholes.append(self._whole(m, chain, np.random.default_rng(child.spawn(1)[0])))
            for a, b in zip(chain, chain[1:]):
                a.next = b
            for a, b in m.graph():
                chain[a].successors.append(chain[b])
                chain[b].predecessors += 1
            self.chains[m.name] = chain
            if isinstance(m, SimModel):
                self.hop[m.name] = cfg.hop(m.activation_bytes)
        self.stages = {s.key: s for chain in self.chains.values() for s in chain}
        self.parts: dict[tuple[int, str], int] = {}     # (request, join stage) -> parts arrived
        # The entry's admission control, per model whose requests are single passes (a generative
        # model's first pass is its prefill: not modelled here).
        self.admission = {m.name: Admission(self.settings.data.admit_wait_s) for m in models
                          if cfg.admission and isinstance(m, SimModel)}
        # Requests, in arrival order over all models.
        names = [m.name for m in models]
        order = [(float(t), k) for k, m in enumerate(names) for t in np.asarray(arrivals.get(m, []))]
        order.sort()
        self.model_of = np.array([k for _, k in order], dtype=np.int32)
        self.sent = np.array([t for t, _ in order], dtype=float)
        n, width = len(order), max(m.num_stages for m in models)
        self.latency = np.full(n, np.nan)
        self.status = np.zeros(n, dtype=np.int32)
        self.wait = np.full((n, width), np.nan, dtype=np.float32)
        self.service = np.full((n, width), np.nan, dtype=np.float32)
        self.outstanding = n
        self.record_arrivals = record_arrivals
        self.arrived: dict[str, list[list[float]]] = {m.name: [[] for _ in range(m.num_stages)] for m in models}
        self.samples = {m.name: {"t": [], "replicas": [], "queue": []} for m in models}
        self.decisions = 0
        self.entry_free = 0.0
        self.generation = GenerationPlane(self, cfg, self.settings.batching, n) \
            if any(isinstance(m, GenerativeModel) for m in models) else None
        self.prompts = {name: list(np.asarray(p, dtype=int)) for name, p in (prompts or {}).items()}
        self.cluster = SimCluster(cfg, self.chains,
                                  scheduler or Scheduler(SchedulerParams.from_settings(self.settings)),
                                  self.schedule, self._serve_next, self.generation.drain if self.generation else None,
                                  cache_key_stages=not self.settings.autoscaler.ablated("fork-cache"),
                                  min_residency_s=self.settings.cache.min_residency_s)
        for whole in wholes:
            self.cluster.add_whole(whole)
        self.slo = {m.name: cfg.slo_x * unloaded_latency(cfg, m) if cfg.slo_x > 0 else cfg.slo_s for m in models}
        self.wake_to = max(1, self.settings.autoscaler.bounds.r_min)
        rules = {m.name: self._rules(m) for m in models if cfg.idle_s > 0 or m.name in self.cluster.wholes}
        self.controller = Controller.from_settings(
            self.settings, {m: tuple(st.ref for st in chain) for m, chain in self.chains.items()},
            self._fits_without_artefacts(models), rules)
        # What the gateway sees of each model's requests: the latest one's time, those in flight.
        self.last_request = {m.name: 0.0 for m in models}
        self.in_flight = {m.name: 0 for m in models}
        self.entered = {m.name: 0 for m in models}     # requests that came in since the layout counted them
        self.windows = {m: ArrivalWindows(r.layout.window_s, r.layout.windows) for m, r in rules.items() if r.layout}

    def _rules(self, m: SimModel | GenerativeModel) -> ModelRules:
        a = self.settings.autoscaler
        layout = LayoutRule(a.layout_windows, self.settings.batching.max_batch, self.cfg.whole_max, a.layout_window_s) \
            if m.name in self.cluster.wholes else None
        sleepers = tuple(range(m.num_stages)) if self.cfg.idle_s > 0 else ()
        return ModelRules(layout, sleepers, self.wake_to, self.cfg.idle_s)

    def _whole(self, m: SimModel, chain: list[Stage], rng: np.random.Generator) -> Stage:
        """A model's whole-model function: one replica computes every stage (their summed mean,
        its profile's CV) on the first stage's queue, as live whole replicas read stage 0's
        stream, and answers; it reads every stage's shard to start."""
        p = m.profile
        whole = Stage(StageRef(m.name, 0, m.num_stages), sum(p.stage_ms(i) for i in range(m.num_stages)) / 1000.0, p.cv, p.parallel_fraction,
                      self.cfg.service_overhead_s, sum(st.shard_bytes for st in chain), rng)
        whole.queue, whole.idle = chain[0].queue, chain[0].idle
        return whole

    def _fits_without_artefacts(self, models: list[SimModel | GenerativeModel]) -> dict[str, dict]:
        """The compensator runs on the fits the live one would (artefacts measured on the emulated
        stages); a model without any gets those of the service law simulated, and a generative
        model none: its batched step has no CPU law here (calibrated at its measured threads)."""
        out = {}
        for m in models:
            if isinstance(m, GenerativeModel):
                out[m.name] = {}
            elif artefacts.find(self.settings.home, artefacts.cpu_fits_name(m.name)) is None:
                out[m.name] = m.cpu_fits(self.cfg.service_overhead_s)
        return out

    def _stage(self, m: SimModel | GenerativeModel, i: int, rng: np.random.Generator) -> Stage:
        if isinstance(m, GenerativeModel):
            st = Stage(StageRef(m.name, i, i + 1), 0.0, 1.0, 0.0, 0.0, m.stage_bytes(i), rng)
            st.cost = m.calibration.stages[i]
            return st
        p = m.profile
        return Stage(StageRef(m.name, i, i + 1), p.stage_ms(i) / 1000.0, p.cv, p.parallel_fraction, self.cfg.service_overhead_s,
                     m.stage_bytes(i), rng)

    # -- events ------------------------------------------------------------------------------

    def schedule(self, t: float, kind: str, a: object = None, b: object = None) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, a, b))

    def run(self) -> Trace:
        cfg = self.cfg
        self.cluster.cache_at_start(cfg.cache_at_start, 0.0)
        for st in self.stages.values():
            st.desired = cfg.initial_replicas
        self.cluster.converge(0.0, instant=True)   # the deployment is up before traffic starts
        last = float(self.sent[-1]) if len(self.sent) else 0.0
        self.end = last + max(cfg.tail_s, 0.0)
        self.give_up = last + cfg.request_timeout_s
        self.schedule(cfg.tick_s, "tick")
        self.schedule(cfg.sample_s, "sample")
        next_arrival, n = 0, len(self.sent)
        heap, pop = self._heap, heapq.heappop
        while True:
            if next_arrival < n and (not heap or self.sent[next_arrival] <= heap[0][0]):
                self.now = float(self.sent[next_arrival])
                self._arrive(next_arrival)
                next_arrival += 1
                continue
            if not heap:
                break
            t, _, kind, a, b = pop(heap)
            self.now = t
            self.events += 1
            if kind == "enq":
                self._enqueue(a, b, t)
            elif kind == "done":
                self._done(a, b, t)
            elif kind == "reply":
                self._reply(a, t)
            elif kind in ("tick", "sample"):
                if self._finished(next_arrival):
                    continue
                (self._tick if kind == "tick" else self._sample)(t)
                self.schedule(t + (cfg.tick_s if kind == "tick" else cfg.sample_s), kind)
            elif kind == "ready":
                self.cluster.on_ready(a, t)
            elif kind == "fluid":
                self.cluster.on_fluid(a, b, t)
            elif kind == "started":
                self.cluster.on_started(a, t)
            elif kind == "received":
                self.cluster.on_received(a, t)
            elif kind == "computed" and isinstance(a, Hop):
                self._hand_on(a, t)
            elif kind in EVENTS:
                self.generation.handle(kind, a, b, t)
        self._expire_rest()
        return self._trace()

    def _finished(self, next_arrival: int) -> bool:
        done = next_arrival >= len(self.sent) and (self.outstanding == 0 or self.now > self.give_up)
        return done and self.now >= self.end

    # -- data plane --------------------------------------------------------------------------

    def _arrive(self, i: int) -> None:
        m = self.models[self.model_of[i]]
        self.last_request[m.name] = self.now
        self.entered[m.name] += 1
        self.in_flight[m.name] += 1
        self.cluster.wake(m.name, self.wake_to, self.now)
        t = self._entry(self.now)
        if isinstance(m, SimModel):  # a generative request's own CPU is in its calibrated steps
            self.cluster.background(self.cluster.servers[0], self.cfg.request_cpu_s, self.now, RequestWork())
        admission = self.admission.get(m.name)
        if admission is not None:
            if admission.refusal(self.now) is not None:
                self._fail(i, 429)
                return
            admission.sent(i, self.now)
        if isinstance(m, GenerativeModel):
            given = self.prompts.get(m.name)
            prompt = int(given.pop(0)) if given else int(self.prompt_rngs[m.name].choice(m.calibration.prompt_tokens))
            self.generation.arrive(i, m, max(1, prompt), self.chains[m.name][0], t)
            return
        self.schedule(t, "enq", self.chains[m.name][0], (i, t))

    # What sim.generation uses of the simulation.
    def entry(self, t: float) -> float:
        return self._entry(t)

    def observe_arrival(self, st: Stage, now: float) -> None:
        st.arrive(now)
        if self.record_arrivals:
            self.arrived[st.model][st.index].append(now)

    def answer(self, i: int, now: float) -> None:
        self._reply(i, now)

    def fail(self, i: int, status: int = 0) -> None:
        self._fail(i, status)

    def _entry(self, t: float) -> float:
        """The entry function is one process doing entry_s / 2 of CPU work per request on the way
        in and again on the way out, first come first served: when initialisations starve it of
        CPU, requests queue there (Lindley's recursion for one FCFS server)."""
        start = max(t, self.entry_free)
        self.entry_free = start + self.cfg.entry_s / 2 * self.cluster.servers[0].slowdown()
        return self.entry_free

    def _enqueue(self, st: Stage, item: tuple[int, float], now: float) -> None:
        if st.predecessors > 1:
            # A join: the request starts here once every predecessor's part is in.
            key = (item[0], st.key)
            self.parts[key] = self.parts.get(key, 0) + 1
            if self.parts[key] < st.predecessors:
                return
            del self.parts[key]
        self.observe_arrival(st, now)
        if st.idle:
            self._begin(st.idle.pop(), item, now)
        else:
            st.queue.append(item)

    def _begin(self, r: SimReplica, item: tuple[int, float], now: float) -> bool:
        i, handed = item
        if now > self.sent[i] + self.cfg.request_timeout_s:
            self._fail(i)          # the entry answered 504 already; the replica drops it
            return False
        st = r.stage
        service = st.service_s(r.server.slowdown())
        r.busy = True
        st.busy += 1
        self.wait[i, st.index] = now - handed
        self.service[i, st.index] = service
        self.schedule(now + service, "done", r, item)
        return True

    def _done(self, r: SimReplica, item: tuple[int, float], now: float) -> None:
        st = r.stage
        i = item[0]
        r.busy = False
        st.busy -= 1
        st.finish(now, float(self.service[i, st.index]), float(self.wait[i, st.index]))
        if self.cfg.item_cpu_s > 0 and r.server.cpu is not None:
            # Its CPU part shares the cores with every other hop and start: a burst whose
            # hand-offs outrun the cores waits there.
            rest = max(0.0, self.hop[st.model] - self.cfg.item_cpu_s)
            self.cluster.compute(r.server, Hop(i, now, tuple(st.successors), rest), self.cfg.item_cpu_s, now)
        else:
            self._hand_on(Hop(i, now, tuple(st.successors), self.hop[st.model] * r.server.slowdown()), now)
        if r.draining:
            self.cluster.release(r)
        else:
            self._serve_next(r, now)

    def _hand_on(self, hop: Hop, now: float) -> None:
        for successor in hop.to:
            self.schedule(now + hop.rest_s, "enq", successor, (hop.i, hop.at))
        if not hop.to:
            self.schedule(self._entry(now + hop.rest_s), "reply", hop.i)

    def _serve_next(self, r: SimReplica, now: float) -> None:
        st = r.stage
        if st.cost is not None:
            self.generation.form(r, now)
            return
        while st.queue:
            if self._begin(r, st.queue.popleft(), now):
                return
        st.idle.append(r)

    def _reply(self, i: int, now: float) -> None:
        if self.status[i]:
            return
        admission = self.admission.get(self.models[self.model_of[i]].name)
        if admission is not None:
            admission.answered(i, float(np.nansum(self.service[i])), now)
        latency = now - self.sent[i]
        if latency > self.cfg.request_timeout_s:
            self._fail(i)
            return
        self.latency[i], self.status[i] = latency, 200
        self._answered(i)

    def _fail(self, i: int, status: int = 0) -> None:
        """Answers a request with an error: 504 (0) at its deadline, another status at once."""
        if not self.status[i]:
            admission = self.admission.get(self.models[self.model_of[i]].name)
            if admission is not None:
                admission.answered(i, None, self.now)
            self.latency[i] = self.cfg.request_timeout_s if not status else self.now - self.sent[i]
            self.status[i] = status or TIMEOUT_STATUS
            self._answered(i)

    def _answered(self, i: int) -> None:
        name = self.models[self.model_of[i]].name
        self.outstanding -= 1
        self.in_flight[name] -= 1
        self.last_request[name] = self.now  # idleness counts from the last answer, as the gateway's

    def _expire_rest(self) -> None:
        for i in np.flatnonzero(self.status == 0):
            self._fail(int(i))

    # -- control plane -----------------------------------------------------------------------

    def _tick(self, now: float) -> None:
        observations = {}
        cpu_free = self._idle_cores(now)
        for m in self.models:
            states = tuple(st.observe(now, self.cfg.window_s) for st in self.chains[m.name])
            observations[m.name] = PipelineState(m.name, states, slo_s=self.slo[m.name],
                                                 edges=m.profile.edges if isinstance(m, SimModel) else None,
                                                 entry_rate=states[0].arrival_rate, now=now,
                                                 cpu_free=None if isinstance(m, SimModel) else cpu_free,
                                                 activity=self._activity(m.name, states) if self.cfg.idle_s > 0 else None,
                                                 asleep=m.name in self.cluster.asleep,
                                                 layout=self._layout(m.name, now) if m.name in self.windows else None)
        self.cluster.now = now
        for actions in self.controller.step(now, observations):
            enact(self.cluster, actions, log)
            self.decisions += 1
        self.cluster.converge(now)
        self.cluster.watch(now)

    def _layout(self, model: str, now: float) -> LayoutState:
        windows, chain, whole = self.windows[model], self.chains[model], self.cluster.wholes[model]
        windows.add(now, self.entered[model])
        self.entered[model] = 0
        serving = tuple(sum(r.ready and not r.draining for r in st.replicas) for st in chain)
        return LayoutState(self.cluster.layouts[model], windows.counts, windows.current, len(chain[0].queue),
                           whole.desired, sum(r.ready and not r.draining for r in whole.replicas), serving)

    def _activity(self, model: str, states: tuple) -> ModelActivity:
        work = self.in_flight[model] + sum(s.queue_length + s.in_flight for s in states)
        return ModelActivity(self.last_request[model], self.cfg.idle_s, sum(s.replicas for s in states), work)

    def _idle_cores(self, now: float) -> float | None:
        """Cores idle since the last tick where the host's cores are modelled (the live loop reads
        /proc/stat for the same figure); None where they are not."""
        fluids = [sv.cpu for sv in self.cluster.servers if sv.cpu is not None]
        if not fluids:
            return None
        for f in fluids:
            f.advance(now)
        used = sum(f.used for f in fluids)
        last_t, last_used = self._cpu_seen
        self._cpu_seen = (now, used)
        if now <= last_t:
            return None
        return sum(f.capacity for f in fluids) - (used - last_used) / (now - last_t)

    def _sample(self, now: float) -> None:
        for m in self.models:
            s = self.samples[m.name]
            s["t"].append(now)
            s["replicas"].append([st.ready_count() for st in self.chains[m.name]])
            s["queue"].append([len(st.queue) for st in self.chains[m.name]])
            if m.name in self.cluster.wholes:
                s.setdefault("whole", []).append(self.cluster.wholes[m.name].ready_count())

    def _trace(self) -> Trace:
        return Trace([m.name for m in self.models], self.model_of, self.sent, self.latency, self.status,
                     self.wait, self.service,
                     {m: [np.array(a) for a in per] for m, per in self.arrived.items()},
                     self.samples, self.decisions, dict(self.cluster.starts), self.events, self.now,
                     self.generation.out if self.generation else None)
