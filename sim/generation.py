"""The simulated data plane of generative models, as the live one runs it (engine/replica.py,
engine/generation_step.py, frontend/entry.py): a request's prefill enters stage 0's shared
queue and passes every stage through its shared queue; the replica that ran it at a stage holds
its KV cache, and every decode step goes to that replica's own queue. A replica batches its
decode steps and new prefills under the shared rule (engine.batch_policy), admits a prefill
only into its KV budget (a prefill waits for room up to kv_wait_s, then 429; one that could
never fit, 413), and costs each batch what its stage's calibration says (sim.step_cost), as
one core's work where the host's cores are modelled. The last stage hands each token to the
entry, which sends the next step; when the last token is out, every holder frees the cache.
A draining replica takes no prefills and either migrates each cache to its least-loaded peer as
the sequence's next step comes (`migrate`) or finishes its sequences (`finish`)."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from contracts.config import Batching
from engine.batch_policy import batch_limit, migration_peer, new_item_slots
from models.decode_batches import FEW_ROWS
from sim.config import SimConfig
from sim.models import GenerativeModel
from sim.stage import SimReplica, Stage
from sim.step_cost import Calibration

PREFILL, DECODE = "p", "d"
EVENTS = ("prefill", "step", "token", "computed", "poll")   # what this plane schedules and handles
TOO_LARGE, NO_ROOM = 413, 429


def hop_s(cfg: SimConfig, cal: Calibration, tokens: int) -> float:
    """A hand-off of `tokens` hidden states: the model's fitted latency where it has one, the
    preset's otherwise, and the bytes over the network."""
    fixed = cfg.hop_s if cal.hop_s is None else cal.hop_s
    return fixed + (cal.hidden_bytes * tokens / cfg.hop_bandwidth if cfg.hop_bandwidth > 0 else 0.0)


class Request:
    __slots__ = ("i", "model", "prompt", "target", "produced", "route", "first_at", "last_at")

    def __init__(self, i: int, model: GenerativeModel, prompt: int) -> None:
        self.i, self.model, self.prompt, self.target = i, model, prompt, model.new_tokens
        self.produced = 0
        self.route: list[SimReplica | None] = [None] * model.num_stages
        self.first_at = self.last_at = 0.0

    @property
    def capacity(self) -> int:
        """Positions reserved at admission: the prompt and every token it may generate."""
        return self.prompt + self.target


@dataclass(eq=False)
class Batch:
    replica: SimReplica
    items: list[tuple]           # (request, handed-off time, kind)
    started: float


@dataclass
class Outcome:
    """Per request (indexed as the simulation's): TTFT, TPOT, tokens, prompt; per stage the batch
    sizes that ran and the most KV bytes one replica held; the KV caches that moved between
    replicas, and the requests recomputed because a cache was lost."""
    ttft: np.ndarray
    tpot: np.ndarray
    tokens: np.ndarray
    prompt: np.ndarray
    batches: dict[str, Counter] = field(default_factory=dict)
    migrations: int = 0
    recomputed: int = 0
    kv_peak: dict[str, int] = field(default_factory=dict)


class GenerationPlane:
    """`sim` is the Simulation: its event queue (schedule), the entry (entry), the stage
    observations (observe_arrival), the per-request arrays and the ends of requests (answer, fail)."""

    def __init__(self, sim, cfg: SimConfig, batching: Batching, n: int) -> None:
        self.sim, self.cfg, self.batching = sim, cfg, batching
        self.out = Outcome(np.full(n, np.nan), np.full(n, np.nan), np.zeros(n, dtype=np.int32),
                           np.zeros(n, dtype=np.int32))

    def handle(self, kind: str, a: object, b: object, now: float) -> None:
        """One of this plane's events (EVENTS), from the simulation's event queue."""
        if kind == "prefill":
            self.enqueue_prefill(a, b, now)
        elif kind == "step":
            self.enqueue_step(a, b, now)
        elif kind == "token":
            self.token(a, now, b)
        elif kind == "computed":
            self.computed(a, now)
        else:
            self.poll(a, now)

    # -- requests ----------------------------------------------------------------------------

    def arrive(self, i: int, model: GenerativeModel, prompt: int, first: Stage, at: float) -> None:
        req = Request(i, model, prompt)
        self.out.prompt[i] = prompt
        self.sim.schedule(at, "prefill", first, (req, at, PREFILL))

    # An arrival wakes an idle replica through a "poll" at the same instant, which runs after every
    # arrival already due then: the items one batch hands on arrive in one transaction live, and
    # the replica that wakes for them reads them all (as the first of several idle ones reads
    # what they left).

    def enqueue_prefill(self, st: Stage, item: tuple, now: float) -> None:
        self.sim.observe_arrival(st, now)
        st.queue.append(item)
        for r in st.idle:
            self.sim.schedule(now, "poll", r)

    def enqueue_step(self, r: SimReplica, item: tuple, now: float) -> None:
        self.sim.observe_arrival(r.stage, now)
        r.private.append(item)
        if r.ready and not r.busy:
            self.sim.schedule(now, "poll", r)

    def token(self, req: Request, now: float, send_at: float) -> None:
        """A token reached the entry: the first sets TTFT; the last answers and frees the caches;
        any other sends the next decode step to the holder of stage 0, at `send_at`."""
        if self._gone(req, now):
            return
        req.produced += 1
        if req.produced == 1:
            req.first_at = now
        req.last_at = now
        if req.produced < req.target:
            hop = self._hop(req, req.route[0].server, 1)
            self.sim.schedule(send_at + hop, "step", req.route[0], (req, send_at, DECODE))
            return
        i, sent = req.i, self.sim.sent[req.i]
        self.out.ttft[i] = req.first_at - sent
        self.out.tpot[i] = (req.last_at - req.first_at) / (req.produced - 1) if req.produced > 1 else 0.0
        self.out.tokens[i] = req.produced
        self.sim.answer(i, now)
        self._free(req, now)

    def _gone(self, req: Request, now: float) -> bool:
        """A request already answered with an error, or past its deadline (then answered 504 here)."""
        if self.sim.status[req.i]:
            return True
        if now > self.sim.sent[req.i] + self.cfg.request_timeout_s:
            self._end(req, 0, now)
            return True
        return False

    def _end(self, req: Request, status: int, now: float) -> None:
        self.sim.fail(req.i, status)
        self._free(req, now)

    def _free(self, req: Request, now: float) -> None:
        """Every holder frees the request's cache; one whose prefill waited for room, or that
        drains, looks again (as an event: this may run inside one of its own batch formations)."""
        for k, r in enumerate(req.route):
            req.route[k] = None
            if r is not None and r.held.pop(req.i, None) is not None:
                r.kv_used -= self._need(req, r.stage)
                if r.waiting or r.draining:
                    self.sim.schedule(now, "poll", r)

    # -- a replica's batches -----------------------------------------------------------------

    def form(self, r: SimReplica, now: float) -> None:
        """The replica's next batch, as engine.replica's _gather then GenerationStage.run take
        it; with nothing to run it goes idle (waiting for shared work unless it is draining)."""
        st = r.stage
        if r in st.idle:
            st.idle.remove(r)
        decodes = self._decodes(r, now)
        take_new = not r.draining and not r.waiting
        new = []
        if take_new:
            slots = new_item_slots(self._limit(st), len(decodes), r.steps_without_new)
            while st.queue and len(new) < slots:
                item = st.queue.popleft()
                if not self._gone(item[0], now):
                    new.append(item)
        r.steps_without_new = 0 if new else r.steps_without_new + 1
        waiting, r.waiting = r.waiting, []
        items = decodes + self._admit(r, [w for w, _ in waiting] + new, dict(waiting), now)
        if items:
            self._run(r, items, now)
        elif r.draining and not r.held and not r.waiting:
            self.sim.cluster.release(r)
        elif not r.draining and not r.waiting:
            st.idle.append(r)

    def _decodes(self, r: SimReplica, now: float) -> list[tuple]:
        """Up to max_batch decode steps from the replica's queue; a draining replica that migrates
        hands each one, with its cache, to its peer instead."""
        peer = self._peer(r) if r.draining and self.batching.drain == "migrate" else None
        out = []
        while r.private and len(out) < self._limit(r.stage):
            item = r.private.popleft()
            if self._gone(item[0], now):
                continue
            if peer is not None:
                self._migrate(item, r, peer, now)
            else:
                out.append(item)
        return out

    def _limit(self, st: Stage) -> int:
        """A step's most items, as engine.replica's: a few where the stage's decode steps are
        priced compiled (sim/step_cost.py: a few rows' reductions, then the packed kernel)."""
        return batch_limit(self.batching.max_batch, FEW_ROWS if st.cost.decode is not None else None)

    def _admit(self, r: SimReplica, prefills: list[tuple], taken: dict, now: float) -> list[tuple]:
        admitted = []
        for item in prefills:
            req = item[0]
            need = self._need(req, r.stage)
            if need > self.batching.kv_bytes:
                self._end(req, TOO_LARGE, now)
            elif r.kv_used + need <= self.batching.kv_bytes:
                self._hold(r, req, need)
                admitted.append(item)
            elif now - taken.get(item, now) < self.batching.kv_wait_s:
                r.waiting.append((item, taken.get(item, now)))
                self.sim.schedule(taken.get(item, now) + self.batching.kv_wait_s, "poll", r)
            else:
                self._end(req, NO_ROOM, now)
        return admitted

    def poll(self, r: SimReplica, now: float) -> None:
        """A replica looks again: work arrived, room was freed, or a prefill waited kv_wait_s for
        it (it runs now or its request gets 429)."""
        if r.ready and not r.busy and r in r.stage.replicas:
            self.form(r, now)

    def _hold(self, r: SimReplica, req: Request, need: int) -> None:
        r.held[req.i] = need
        r.kv_used += need
        req.route[r.stage.index] = r
        key = r.stage.key
        self.out.kv_peak[key] = max(self.out.kv_peak.get(key, 0), r.kv_used)

    def _need(self, req: Request, st: Stage) -> int:
        return req.capacity * req.model.calibration.kv_bytes_per_position[st.index]

    def _run(self, r: SimReplica, items: list[tuple], now: float) -> None:
        st = r.stage
        steps = [(item[0].prompt + item[0].produced, 0) if item[2] == PREFILL else (1, item[0].prompt + item[0].produced - 1)
                 for item in items]
        r.busy = True
        st.busy += 1
        batch = Batch(r, items, now)
        for item in items:
            if item[2] == PREFILL and np.isnan(self.sim.wait[item[0].i, st.index]):
                self.sim.wait[item[0].i, st.index] = now - item[1]
        self.out.batches.setdefault(st.key, Counter())[len(items)] += 1
        self.sim.cluster.compute(r.server, batch, st.cost.batch_s(steps), now)
        self.sim.cluster.background(r.server, items[0][0].model.calibration.item_cpu_s * len(items), now)

    def computed(self, batch: Batch, now: float) -> None:
        """A batch is done: each request's output goes on (prefills to the next stage's shared
        queue, decode steps to the next holder, tokens to the entry) and the replica goes on."""
        r = batch.replica
        st = r.stage
        r.busy = False
        st.busy -= 1
        per_item = (now - batch.started) / len(batch.items)
        answered = []
        for req, handed, kind in batch.items:
            st.finish(now, per_item, now - per_item - handed)
            if kind == PREFILL and np.isnan(self.sim.service[req.i, st.index]):
                self.sim.service[req.i, st.index] = now - batch.started
            if self.sim.status[req.i]:
                continue
            arrive = now + self._hop(req, r.server, req.prompt + req.produced if kind == PREFILL else 1)
            if st.next is None:
                answered.append((req, self.sim.entry(arrive)))
            else:
                self._hand_on(req, st, kind, arrive, now)
        # The entry handles a batch's tokens in turn, then sends their next steps in one
        # transaction (frontend/step_sender.py): they reach stage 0 together and stay one batch.
        send_at = max((t for _, t in answered), default=now)
        for req, handled in answered:
            self.sim.schedule(handled, "token", req, send_at)
        self.form(r, now)

    def _hand_on(self, req: Request, st: Stage, kind: str, arrive: float, now: float) -> None:
        """A request's output goes on to the next stage: a prefill to its shared queue, a
        decode step to the replica holding its cache there."""
        if kind == PREFILL:
            self.sim.schedule(arrive, "prefill", st.next, (req, now, PREFILL))
        else:
            self.sim.schedule(arrive, "step", req.route[st.index + 1], (req, now, DECODE))

    def _hop(self, req: Request, server: object, tokens: int) -> float:
        return hop_s(self.cfg, req.model.calibration, tokens) * server.slowdown()

    # -- drains ------------------------------------------------------------------------------

    def drain(self, r: SimReplica, now: float) -> None:
        """The cluster removes a replica that holds sequences: it stops taking prefills; with
        nothing running it goes on at once (migrating or finishing what it holds)."""
        if r in r.stage.idle:
            r.stage.idle.remove(r)
        if not r.busy:
            self.form(r, now)

    def _peer(self, r: SimReplica) -> SimReplica | None:
        peers = {p.id: p for p in r.stage.replicas if p is not r and p.ready and not p.draining}
        chosen = migration_peer({pid: len(p.held) for pid, p in peers.items()})
        return peers.get(chosen) if chosen else None

    def _migrate(self, item: tuple, r: SimReplica, peer: SimReplica, now: float) -> None:
        """The step and its cache go to the peer. A peer without room loses the cache, and the
        entry recomputes the request (λScale §4.4): every cache freed, a prefill of the prompt and
        the tokens made so far from stage 0."""
        req = item[0]
        need = r.held.pop(req.i)
        r.kv_used -= need
        self.out.migrations += 1
        if peer.kv_used + need > self.batching.kv_bytes:
            self._free(req, now)
            self.out.recomputed += 1
            self.sim.schedule(self.sim.entry(now), "prefill", self.sim.chains[req.model.name][0], (req, now, PREFILL))
            return
        self._hold(peer, req, need)
        cache = (req.prompt + req.produced) * req.model.calibration.kv_bytes_per_position[r.stage.index]
        moved = self.cfg.migrate_s + (cache / self.cfg.migrate_bandwidth if self.cfg.migrate_bandwidth > 0 else 0.0)
        self.sim.schedule(now + moved, "step", peer, item)

