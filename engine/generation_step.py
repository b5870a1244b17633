"""What a stage replica of a generative model does with one batch of work items, without I/O:
frees, decode steps on the sequences it holds, and prefills admitted into its KV budget, run as
one batched forward; the result says where each output goes. The replica reads and writes Redis."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from contracts.config import Limits
from contracts.wire import BadRequest, Header
from engine.batch_policy import MIGRATE
from engine.step_profile import StepProfile
from models.batched_decoder import Step
from models.kv_cache import KVStore, NoRoom, split_cache
from models.sampling import Sampling, all_finite, sample
from models.stage_runner import StageRunner


@dataclass
class Work:
    """One message taken from a stream and not yet acknowledged."""
    stream: str
    msg_id: bytes
    header: Header
    tensors: dict[str, torch.Tensor]
    received: float = field(default_factory=time.time)
    # Cache tensors this step carries on to later stages (a gather on its way, a split's rest).
    carried: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def queued_s(self) -> float:
        """How long it waited in its stream (fixed when taken: the hand-off restamps the header)."""
        return max(0.0, self.received - self._enqueued_at)

    def __post_init__(self) -> None:
        self._enqueued_at = self.header.enqueued_at if self.header is not None else self.received


# Where an outcome goes: the next stage's shared stream (a prefill; the rest of a split cache),
# the private stream of the replica holding the sequence at the next stage (a decode), a peer of
# this stage taking the sequence over (a migration), the replica a gathered cache goes to, the
# entry's reply list, or (from the last stage) the first stage's holder: the next decode step.
NEXT, HOLDER, PEER, INSTALL, REPLY, FIRST = "next", "holder", "peer", "install", "reply", "first"


@dataclass
class Outcome:
    work: Work
    to: str
    header: Header
    tensors: dict[str, torch.Tensor]
    peer: str = ""
    # This replica's cache of the sequence left with this outcome (a migration, a gather passing
    # through): the entry's route may name this replica until the step's answer reaches it.
    handed_on: bool = False


@dataclass
class BatchResult:
    outcomes: list[Outcome]
    done: list[Work]               # acknowledge these (everything taken, less what waits for room)
    batch: int = 0                 # steps that ran as one forward
    service_s: float = 0.0
    compiled: bool = False         # through the compiled decode step


class GenerationStage:
    def __init__(self, runner: StageRunner, replica_id: str, budget_bytes: int, kv_wait_s: float,
                 limits: Limits) -> None:
        self.runner, self.limits = runner, limits
        self.engine = runner.batched()
        self.store = KVStore(self.engine.kv_shape(), budget_bytes)
        self.replica_id = replica_id
        self.kv_wait_s = kv_wait_s
        self.first, self.last, self.is_last = runner.first, runner.last, runner.is_last
        self.first_layer = runner.manifest.stages[runner.first].layers[0]
        self.end_layer = runner.manifest.stages[runner.last - 1].layers[1]
        self.max_positions = runner.modules[0].config.max_position_embeddings
        self.waiting: list[Work] = []  # prefills taken that wait for KV room, oldest first

    def run(self, works: list[Work], handover: tuple[str, str] | None = None) -> BatchResult:
        """One step over `works`. With `handover` (this replica is draining: a peer and how), each
        decode step of a sequence held here moves the sequence's cache to that peer: with the
        step (MIGRATE), or after running it, through the later holders (GATHER)."""
        outcomes: list[Outcome] = []
        steps: list[tuple[Work, Step]] = []
        for w in works:
            kind = w.header.kind
            if kind == "free":
                self.store.free(w.header.seq)
            elif kind == "decode":
                if handover and w.header.seq in self.store.sequences and not w.header.gather:
                    peer, how = handover
                    if how == MIGRATE:
                        outcomes.append(self._migrate(w, peer))
                        continue
                    self._start_gather(w.header, peer)
                self._decode(w, steps, outcomes)
            elif kind == "adopt":
                self._adopt(w, steps, outcomes)
            elif kind == "install":
                self._install(w)
            elif kind == "prefill":
                self._prefill(w, steps, outcomes)
            elif kind == "fork":
                outcomes.append(self._fork(w))
            else:
                outcomes.append(_error(w, BadRequest("a generative stage takes prefill, decode, adopt, install, "
                                                     f"fork or free, not {kind!r}")))
        done = [w for w in works if w not in self.waiting]
        if not steps:
            return BatchResult(outcomes, done)
        started, profile = time.perf_counter(), StepProfile(self.store.shape.device)
        batch = [s for _, s in steps]
        # Decided once, so the record says how the step ran (the compile finishes on another thread).
        compiled = self.engine.runs_compiled(batch)
        try:
            outputs = self.engine.forward(batch, compiled=compiled)
        except Exception as exc:  # one bad batch must not take the replica down; its requests get the error
            for w, s in steps:
                self.store.free(s.seq.seq_id)
                outcomes.append(_error(w, exc, 500))
            return BatchResult(outcomes, done, len(steps), time.perf_counter() - started)
        profile.done(len(steps), self.first)
        service = time.perf_counter() - started
        for (w, s), out in zip(steps, outputs):
            outcomes += self._hand_off(w, s, out)
        return BatchResult(outcomes, done, len(steps), service, compiled)

    def _start_gather(self, h: Header, peer: str) -> None:
        """From this step on the sequence lives at `peer`: the reply's route names it here, and
        the route's later holders, each handing its cache on, are dropped from it at the end."""
        h.gather = peer
        h.route[str(self.first)] = peer

    def _decode(self, w: Work, steps: list, outcomes: list) -> None:
        w.carried, w.tensors = split_cache(w.tensors)
        seq = self.store.get(w.header.seq)
        if seq is None or seq.length != w.header.start:
            outcomes.append(_lost(w))
            return
        inputs = self._inputs(w, outcomes)
        if inputs is None:
            return
        if inputs.shape[0] != 1:
            outcomes.append(_error(w, BadRequest("a decode step takes exactly one token")))
            return
        steps.append((w, Step(seq, inputs, w.header.start)))

    def _migrate(self, w: Work, peer: str) -> Outcome:
        """The step and the sequence's cache, for the peer to adopt; the cache leaves this replica."""
        h = w.header
        seq = self.store.sequences[h.seq]
        h.kind, h.capacity = "adopt", seq.capacity
        tensors = {**w.tensors, **self.store.export(h.seq, self.first_layer)}
        self.store.free(h.seq)
        return Outcome(w, PEER, h, tensors, peer, handed_on=True)

    def _adopt(self, w: Work, steps: list, outcomes: list) -> None:
        """A decode step that brings its sequence's cache: this replica keeps its own layers and
        carries the later ones on (a wider replica's cache split over narrower ones)."""
        h = w.header
        cache, inputs = split_cache(w.tensors)
        try:
            seq = self.store.adopt(h.seq, h.capacity, cache, self.first_layer)
        except (NoRoom, ValueError, KeyError):  # nothing was admitted
            outcomes.append(_lost(w))  # the entry prefills again elsewhere
            return
        if seq.length != h.start:
            self.store.free(h.seq)
            outcomes.append(_lost(w))
            return
        h.kind, w.tensors = "decode", inputs
        w.carried = {k: v for k, v in cache.items() if int(k[1:]) >= self.end_layer}
        h.route[str(self.first)] = self.replica_id
        step = self._inputs(w, outcomes)
        if step is None:
            self.store.free(h.seq)
            return
        steps.append((w, Step(seq, step, h.start)))

    def _fork(self, w: Work) -> Outcome:
        """Another choice of a request whose prompt a sequence here holds: a copy of the prompt's
        cache, no step run; on to the next stage's holder, or (the last stage) back to the entry.
        Lost when the parent is gone or the copy does not fit: the choice prefills itself."""
        h = w.header
        try:
            self.store.fork(h.parent, h.seq, h.capacity, h.start)
        except (KeyError, NoRoom):
            return _lost(w)
        h.stage, h.enqueued_at = self.last, time.time()
        return Outcome(w, REPLY if self.is_last else HOLDER, h, {})

    def _install(self, w: Work) -> None:
        """Takes a gathered sequence's cache (every layer of this replica's range). One that does
        not fit or is incomplete is dropped: the next step finds no cache and the entry prefills
        again."""
        h = w.header
        try:
            self.store.adopt(h.seq, h.capacity, w.tensors, self.first_layer)
        except (NoRoom, ValueError, KeyError):
            self.store.free(h.seq)

    def _prefill(self, w: Work, steps: list, outcomes: list) -> None:
        inputs = self._inputs(w, outcomes)
        if inputs is None:
            return
        h = w.header
        if w.header.start != 0 or not inputs.shape[0] <= h.capacity <= self.max_positions:
            outcomes.append(_error(w, BadRequest(f"a prefill of {inputs.shape[0]} tokens starts at 0 and reserves "
                                                 f"at least as many positions (got start {h.start}, capacity {h.capacity})")))
            return
        if not self.store.fits_ever(h.capacity):
            outcomes.append(_error(w, BadRequest(f"{h.capacity} positions need {self.store.need(h.capacity)} bytes of "
                                                 f"KV cache; this stage's budget is {self.store.budget}", status=413)))
            return
        try:
            seq = self.store.admit(h.seq, h.capacity)
        except NoRoom:
            if w in self.waiting:
                if time.time() - w.received < self.kv_wait_s:
                    return
                self.waiting.remove(w)
            elif self.kv_wait_s > 0:
                self.waiting.append(w)
                return
            h.retry_after = max(1.0, self.kv_wait_s)
            outcomes.append(_error(w, BadRequest(f"stage {self.first} has no KV room for {h.capacity} positions "
                                                 f"({self.store.used} of {self.store.budget} bytes in use)", status=429)))
            return
        if w in self.waiting:
            self.waiting.remove(w)
        steps.append((w, Step(seq, inputs, 0)))

    def _inputs(self, w: Work, outcomes: list) -> torch.Tensor | None:
        """The step's tokens or hidden states without the batch dimension; None (and an error
        outcome) when they are malformed."""
        try:
            self.runner.validate(w.tensors, self.limits, 1)
        except BadRequest as exc:
            outcomes.append(_error(w, exc))
            return None
        name = "input_ids" if "input_ids" in w.tensors and self.engine.embed is not None else "hidden"
        return w.tensors[name][0]

    def _hand_off(self, w: Work, s: Step, out: torch.Tensor) -> list[Outcome]:
        h = w.header
        if h.kind == "prefill":
            h.route[str(self.first)] = self.replica_id
        h.stage, h.enqueued_at = self.last, time.time()
        handed_on = bool(h.gather) and h.gather != self.replica_id
        if h.gather:  # this holder's cache leaves with the step
            h.capacity = s.seq.capacity
            w.carried.update(self.store.export(h.seq, self.first_layer))
            self.store.free(h.seq)
        if not self.is_last:
            if w.carried and not h.gather:  # the rest of a split cache: the next stage adopts it
                h.kind = "adopt"
            to = NEXT if h.kind in ("prefill", "adopt") else HOLDER
            return [Outcome(w, to, h, {"hidden": out.unsqueeze(0), **w.carried}, handed_on=handed_on)]
        if not all_finite(out):
            return [_error(w, BadRequest("the stage produced NaN or infinity", status=422))]
        sampling = Sampling.from_dict(h.sampling)
        # A prefill that several choices share samples each one's first token.
        choices = sampling.choices if h.kind == "prefill" else 1
        sampled = sample(out, sampling, s.start + s.tokens, choices)
        reply = Outcome(w, REPLY, h, sampled, handed_on=handed_on)
        if not h.gather:
            following = self._next_step(w, s, int(sampled["token"][0])) if choices == 1 else None
            return [reply] if following is None else [following, reply]
        # The gathered cache first (one transaction, in order): the entry's next step finds it.
        installed = Header(**{**vars(h), "kind": "install", "start": s.start + s.tokens, "timings": []})
        at = min(int(k) for k, v in h.route.items() if v == h.gather)
        h.route = {k: v for k, v in h.route.items() if int(k) <= at}
        return [Outcome(w, INSTALL, installed, w.carried, h.gather, handed_on=True), reply]

    def _next_step(self, w: Work, s: Step, token: int) -> Outcome | None:
        """The sequence's next decode step, sent by the last stage itself where the entry asks
        (`Header.chain`) and the entry would send it: the token does not end the generation and
        the sequence has room for another. Why: the entry's turn between the last stage's answer
        and the next step was 1.6 ms of a 32 ms token (one request, SmolLM2 in 4 stages on the
        2-core EPYC; `python -m benchmarks token_anatomy`); off the path, the entry streams the
        token while the first stage already runs the next step. A generation that ends on a stop
        sequence or a client gone runs one step more, freed with the rest."""
        h = w.header
        start = s.start + s.tokens
        if not h.chain or token in h.stop_tokens or start + 1 >= s.seq.capacity or time.time() > h.deadline:
            return None
        following = h.next_decode(start)
        h.next_step = following.request_id
        return Outcome(w, FIRST, following, {"input_ids": torch.tensor([[token]])})

    def evict_idle(self, idle_s: float) -> list[str]:
        return self.store.expire(idle_s)


def _error(w: Work, exc: Exception, status: int | None = None) -> Outcome:
    h = w.header
    h.error = f"stage {h.stage}: {exc}"
    h.status = status or getattr(exc, "status", 500)
    return Outcome(w, REPLY, h, {})


def _lost(w: Work) -> Outcome:
    w.header.kind = "lost"
    return Outcome(w, REPLY, w.header, {})
