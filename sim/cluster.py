"""The simulated servers and the mechanism behind the autoscaler's Backend interface: desired
replica counts, the placement scheduler's decisions carried out as fork or cold starts, cold
reads sharing each server's bandwidth (HydraServe Eq. 4), drains, and each server's KeysManager
caching key stages under its byte budget (keysmanager.cache_policy). No policy lives here."""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from autoscaler.policy.layout import LayoutDecision
from contracts.stage import StageRef
from keysmanager.cache_policy import WARMING_AT_ONCE, Held, OverBudget, evictions
from scheduler.placement import Scheduler
from scheduler.state import Change, ClusterState, Fetch, PlacedReplica, ReplicaId, Schedule, ServerView, cluster_state
from sim.config import SimConfig
from sim.fluid import Fluid
from sim.stage import SimReplica, Stage
from state.records import PIPELINED


@dataclass(eq=False)
class Zygote:
    bytes: int
    last_use: float
    ready: bool = False
    cached_at: float = float("-inf")


class Background:
    """A token for CPU work nobody waits on."""


class RequestWork(Background):
    """A request's CPU outside the stages (the entry, the gateway, the load generator): it takes
    its share of the cores and slows the data plane only by that share."""


@dataclass(frozen=True)
class Hop:
    """A stage's hand-off of request `i` (finished at `at`) where its CPU part shares the host's
    cores; the rest of the hop, `rest_s`, follows it. `to`: the stages it goes to (none: the reply)."""
    i: int
    at: float
    to: tuple
    rest_s: float


@dataclass
class Server:
    name: str
    slots: int
    budget: int
    used: int = 0
    zygotes: dict[str, Zygote] = field(default_factory=dict)
    reads: Fluid = field(default_factory=lambda: Fluid(1.0))   # shard reads sharing the bandwidth
    cpu: Fluid | None = None                                  # initialisations sharing the cores

    def slowdown(self) -> float:
        """How much slower the data plane's own CPU work runs while initialisations hold the
        cores (1 where the host's cores are not modelled)."""
        if self.cpu is None:
            return 1.0
        starts = sum(1 for token, _ in self.cpu.jobs if not isinstance(token, (Hop, RequestWork)))
        return max(1.0, (starts + 1) / self.cpu.capacity)

    def cached(self) -> frozenset[str]:
        return frozenset(k for k, z in self.zygotes.items() if z.ready)


class SimCluster:
    """`schedule_event(t, kind, a, b)` is the simulation's event queue; its "ready", "fluid" and
    "started" events come back through `on_ready`, `on_fluid` and `on_started`."""

    def __init__(self, cfg: SimConfig, chains: dict[str, list[Stage]], scheduler: Scheduler,
                 schedule_event: Callable, start_serving: Callable[[SimReplica, float], None],
                 drain_generative: Callable[[SimReplica, float], None] | None = None,
                 cache_key_stages: bool = True, min_residency_s: float = 0.0) -> None:
        self.cfg, self.by_model, self.scheduler = cfg, chains, scheduler
        self.stages = {s.key: s for chain in chains.values() for s in chain}
        self.servers = [Server(f"server-{i}", cfg.slots, cfg.cache_budget, reads=Fluid(cfg.bandwidth),
                               cpu=Fluid(cfg.host_cores, 1.0) if cfg.host_cores > 0 else None)
                        for i in range(cfg.servers)]
        self._startup: deque = deque()
        self._by_name = {s.name: s for s in self.servers}
        self.key_stages: dict[str, tuple[StageRef, ...]] = {}
        self._event, self._start_serving = schedule_event, start_serving
        self._drain_generative = drain_generative     # a generative stage's replica leaves through its data plane
        self.cache_key_stages = cache_key_stages
        self.min_residency_s = min_residency_s
        self._ids = 0
        self.placements: list[dict] = []
        self.starts = {"fork": 0, "cold": 0, "peer": 0}
        # The model store's one link where the servers share it (cfg.store_bandwidth), and the
        # server each read through it is for.
        self.store = Fluid(cfg.store_bandwidth) if cfg.store_bandwidth > 0 else None
        self._store_reads: dict[object, Server] = {}
        self.now = 0.0                         # the simulation's time when the controller's actions come
        self.asleep: set[str] = set()          # models whose stage functions sleep at zero
        self.wholes: dict[str, Stage] = {}     # each model's whole-model function, where it has one
        self.layouts: dict[str, str] = {}      # each such model's layout
        self.layout_changes: list[tuple[float, str, str, str]] = []   # (when, model, layout, why)

    # -- the autoscaler's Backend ------------------------------------------------------------

    def set_replicas(self, stage: StageRef, replicas: int) -> None:
        self.by_model[stage.model][stage.first].desired = replicas

    def set_cpus(self, stage: StageRef, cpus: int) -> None:
        self.by_model[stage.model][stage.first].cpus = cpus

    def publish_key_stages(self, model: str, stages: tuple[StageRef, ...]) -> None:
        self.key_stages[model] = stages

    def add_whole(self, whole: Stage) -> None:
        """A model's whole-model function: placed like any stage, pipelined to start with."""
        self.wholes[whole.model] = self.stages[whole.key] = whole
        self.layouts[whole.model] = PIPELINED

    def set_whole(self, model: str, replicas: int) -> None:
        self.wholes[model].desired = replicas

    def set_layout(self, model: str, change: LayoutDecision) -> None:
        self.layouts[model] = change.layout
        self.layout_changes.append((self.now, model, change.layout, change.reason))

    def set_asleep(self, model: str, asleep: bool) -> None:
        (self.asleep.add if asleep else self.asleep.discard)(model)

    def wake(self, model: str, replicas: int, now: float) -> bool:
        """The gateway's scale from zero: a request for a sleeping model wakes every stage at once."""
        if model not in self.asleep:
            return False
        self.asleep.discard(model)
        for st in self.by_model[model]:
            st.desired = max(st.desired, replicas)
        self.converge(now)
        return True

    def key_stage_keys(self) -> frozenset[str]:
        return frozenset(s.key for ks in self.key_stages.values() for s in ks)

    # -- placement ---------------------------------------------------------------------------

    def state(self, now: float) -> ClusterState:
        servers = []
        for sv in self.servers:
            reads = self._reads(sv)
            reads.advance(now)
            fetches = tuple(Fetch(p, r.started_at + self.cfg.cold_deadline_s) for r, p in reads.jobs
                            if isinstance(r, SimReplica) and r.server is sv)
            servers.append(ServerView(sv.name, sv.slots, self.cfg.bandwidth, sv.cached(), sv.used, fetches))
        replicas = [(PlacedReplica(r.id, st.key, r.server.name, r.started_by, r.ready, r.started_at), r.draining)
                    for st in self.stages.values() for r in st.replicas]
        return cluster_state(servers, replicas, self.key_stage_keys(), now, self.cfg.cache_budget,
                             self.cfg.store_bandwidth)

    def converge(self, now: float, instant: bool = False) -> Schedule | None:
        """Moves every stage towards its desired count through the scheduler; `instant` places
        replicas that are up at once (the deployment a run starts from)."""
        changes = [Change(st.key, st.desired - len(st.serving()), st.shard_bytes, self.cfg.cold_deadline_s)
                   for st in self.stages.values() if st.desired != len(st.serving())]
        if not changes:
            return None
        schedule = self.scheduler.schedule(self.state(now), changes)
        for removal in schedule.removals:
            st = self.stages[removal.stage]
            self.remove(next(r for r in st.replicas if r.id == removal.replica), now)
        for p in schedule.placements:
            r = self.start(self.stages[p.stage], self._by_name[p.server], "up" if instant else p.path, now,
                           p.predicted_s)
            if instant:
                self.on_ready(r, now)
        return schedule

    def start(self, st: Stage, sv: Server, path: str, now: float, arrival_s: float = 0.0) -> SimReplica:
        """A replica of `st` on `sv` by `path`: "fork", "cold", "peer" (its stage arrives from the
        servers that cache it after the scheduler's `arrival_s`, the links' other traffic not
        modelled) or "up" (there at once)."""
        self._ids += 1
        z = sv.zygotes.get(st.key)
        forked = path == "fork" and z is not None and z.ready
        r = SimReplica(ReplicaId(sv.name, self._ids), st, sv, "fork-cow" if forked else "cold", now)
        st.replicas.append(r)
        sv.used += 1
        if path == "up":
            return r
        self.starts["fork" if forked else path if path == "peer" else "cold"] += 1
        if forked:
            z.last_use = now
            copy = st.shard_bytes / self.cfg.h2d_bandwidth if self.cfg.h2d_bandwidth > 0 else 0.0
            self._event(now + self.cfg.fork_s + copy, "ready", r)
        elif path == "peer":
            self._event(now + arrival_s, "received", r)
        else:
            self._read(sv, r, st.shard_bytes, now)
        return r

    def remove(self, r: SimReplica, now: float) -> None:
        """Starting replicas are cancelled, idle ones leave at once, busy ones after their item;
        a generative stage's replica drains through the data plane."""
        sv = r.server
        r.draining = True            # a pending start finds it draining and drops it
        if not r.ready:
            for phase in ("reads", "cpu"):
                fluid = self._reads(sv) if phase == "reads" else sv.cpu
                if fluid is not None and fluid.remove(r, now):
                    self._store_reads.pop(r, None)
                    self._next(sv, phase, now)
            self.release(r)
        elif r.stage.cost is not None:
            self._drain_generative(r, now)
        elif not r.busy:
            r.stage.idle.remove(r)
            self.release(r)

    def release(self, r: SimReplica) -> None:
        if r in r.stage.replicas:
            r.stage.replicas.remove(r)
            r.server.used -= 1

    # -- start paths -------------------------------------------------------------------------

    def on_ready(self, r: SimReplica, now: float) -> None:
        if r.draining or r.ready:
            return
        r.ready = True
        self._start_serving(r, now)

    def on_received(self, r: SimReplica, now: float) -> None:
        """A peer start's stage has arrived: the replica initialises (unless it was removed)."""
        if not r.draining:
            self._initialise(r.server, r, now)

    def _reads(self, sv: Server) -> Fluid:
        """What a cold read on `sv` shares: the model store's link, or the server's own."""
        return self.store if self.store is not None else sv.reads

    def _read(self, sv: Server, token: SimReplica | Zygote, nbytes: float, now: float) -> None:
        if self.store is not None:
            self._store_reads[token] = sv
        self._reads(sv).add(token, float(nbytes), now)
        self._next(sv, "reads", now)

    def _initialise(self, sv: Server, token: SimReplica | Zygote, now: float) -> None:
        """A runtime start: init_s of one core's work, shared with the others where cores are modelled."""
        if sv.cpu is None:
            self._event(now + self.cfg.init_s, "started", token)
            return
        sv.cpu.add(token, self.cfg.init_s, now)
        self._next(sv, "cpu", now)

    def _next(self, sv: Server, phase: str, now: float) -> None:
        fluid = self._reads(sv) if phase == "reads" else sv.cpu
        t = fluid.next_done(now)
        if t is not None:
            self._event(t, "fluid", (sv, phase), fluid.version)

    def on_fluid(self, where: tuple[Server, str], version: int, now: float) -> None:
        sv, phase = where
        fluid = self._reads(sv) if phase == "reads" else sv.cpu
        if version != fluid.version:
            return
        for token in fluid.finished(now):
            if phase == "reads":
                self._initialise(self._store_reads.pop(token, sv), token, now)
            else:
                self.on_started(token, now)
        self._next(sv, phase, now)

    def on_started(self, token: object, now: float) -> None:
        if isinstance(token, SimReplica):
            self.on_ready(token, now)
        elif isinstance(token, Zygote):
            self.on_cached(token, now)
        elif not isinstance(token, Background):
            self._event(now, "computed", token)

    def compute(self, sv: Server, token: object, seconds: float, now: float) -> None:
        """A batch of one core's work: on its own where the host's cores are not modelled,
        sharing them with every other batch and initialisation where they are. Its end comes
        back as a "computed" event."""
        if sv.cpu is None:
            self._event(now + seconds, "computed", token)
            return
        sv.cpu.add(token, seconds, now)
        self._next(sv, "cpu", now)

    def background(self, sv: Server, seconds: float, now: float, token: Background | None = None) -> None:
        """CPU work that delays nothing by itself but takes its share of the cores while it runs
        (other processes' work: Redis, the entry); nothing where the cores are not modelled."""
        if sv.cpu is not None and seconds > 0:
            sv.cpu.add(token or Background(), seconds, now)
            self._next(sv, "cpu", now)

    # -- the KeysManagers --------------------------------------------------------------------

    def cache(self, sv: Server, st: Stage, now: float, ready: bool = False) -> bool:
        """One server's KeysManager caches a stage: room made by the cache policy, then the
        shard read into host memory (a zygote start); `ready`: cached before the run began."""
        if st.key in sv.zygotes:
            return True
        held = [Held(k, z.bytes, z.last_use, cached_at=z.cached_at) for k, z in sv.zygotes.items()]
        try:
            for key in evictions(held, set(self.key_stage_keys()), sv.budget, st.shard_bytes, now, self.min_residency_s):
                del sv.zygotes[key]
        except OverBudget:
            return False
        z = sv.zygotes[st.key] = Zygote(st.shard_bytes, now, cached_at=now, ready=ready)
        if not ready:
            self._read(sv, z, st.shard_bytes, now)
        return True

    def on_cached(self, z: Zygote, now: float) -> None:
        z.ready, z.last_use = True, now
        if self._startup:
            sv, st = self._startup.popleft()
            self.cache(sv, st, now)

    def watch(self, now: float) -> None:
        """Each KeysManager caches the key stages scheduled on its server that it does not hold
        (keysmanager watch_once, QUART §6.1), unless the fork cache is ablated."""
        if not self.cache_key_stages:
            return
        for key in sorted(self.key_stage_keys()):
            st = self.stages[key]
            for sv in {r.server.name: r.server for r in st.replicas if not r.draining}.values():
                self.cache(sv, st, now)

    def cache_at_start(self, how: str, now: float) -> None:
        """The embedded runtime's start (cache_stages=all), stages round-robin over servers:
        "all" ready at once; "parallel" as its KeysManagers do it, four ready and the others
        warming four at a time; "sequential" one after another, the first ready; "none"."""
        if how not in ("all", "parallel", "sequential", "none"):
            raise ValueError(f"cache_at_start is all, parallel, sequential or none, not {how!r}")
        plan = [(self.servers[n % len(self.servers)], st) for n, st in enumerate(self.stages.values())]
        if how == "all":
            for sv, st in plan:
                self.cache(sv, st, now, ready=True)
        elif how in ("parallel", "sequential"):
            # The first batch is in when traffic starts (`make up` reported 4 of 8 cached when
            # the live replays began); the rest warm as many at a time.
            at_once = WARMING_AT_ONCE if how == "parallel" else 1
            for sv, st in plan[:at_once]:
                self.cache(sv, st, now, ready=True)
            self._startup.extend(plan[at_once:])
            for _ in range(min(at_once, len(self._startup))):
                sv, st = self._startup.popleft()
                self.cache(sv, st, now)
