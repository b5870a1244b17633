"""The live side of a model's layout (the rule is autoscaler/policy/layout.py): per model with a
whole-model function, it counts the requests arriving in each window, reads what the model holds
and which replicas serve, and carries the rule's decision out through the backend. The layout is
kept in Redis, so a restarted autoscaler goes on from it."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import redis

from autoscaler.backends import Backend
from autoscaler.policy.layout import LayoutDecision, LayoutRule, LayoutState, decide
from contracts.stack import Pipeline
from state import keys
from state.records import LayoutChange, StageSample
from state.store import RedisStore

log = logging.getLogger("quart.layout")


@dataclass
class LayoutController:
    r: redis.Redis
    backend: Backend
    pipeline: Pipeline
    rule: LayoutRule
    window_s: float
    records_maxlen: int = 10_000
    counts: list[int] = field(default_factory=list)
    current: int = 0
    window_started: float = 0.0
    _last_id: bytes | None = None

    def step(self, now: float | None = None) -> LayoutDecision | None:
        """One look: the rule's decision, carried out (None: nothing changes)."""
        now = time.time() if now is None else now
        self._count_arrivals(now)
        state = self.observe()
        decision = decide(state, self.rule)
        if decision is not None:
            self.apply(decision, now)
            log.info("%s: %s -> %s (%s)", self.pipeline.model, state.layout, decision.layout, decision.reason)
        return decision

    def layout(self) -> str:
        return RedisStore(self.r).layout(self.pipeline.model)

    def _count_arrivals(self, now: float) -> None:
        """New requests (prefills and passes entering stage 0) since the last look, into windows;
        the first look only marks where counting starts."""
        stream = keys.records_stream(self.pipeline.model, 0)
        if self._last_id is None:
            last = self.r.xrevrange(stream, count=1)
            self._last_id, self.window_started = (last[0][0] if last else b"0-0"), now
            return
        while now >= self.window_started + self.window_s:
            self.counts = (self.counts + [self.current])[-self.rule.windows:]
            self.current, self.window_started = 0, self.window_started + self.window_s
        for entry_id, f in self.r.xrange(stream, min=b"(" + self._last_id):
            self._last_id = entry_id
            self.current += StageSample.decode(entry_id, f).starts_request

    def observe(self) -> LayoutState:
        p = self.pipeline
        store = RedisStore(self.r)
        live = store.live_among((p.model, s.first) for s in p.stages)
        at_first = live[(p.model, 0)]
        serving = [[x for x in live[(p.model, s.first)] if not x.draining and x.serves(s)] for s in p.stages]
        whole = [x for x in at_first if x.stage_end == p.num_stages and not x.draining]
        desired = self.backend.function_replicas(p.whole)
        return LayoutState(self.layout(), tuple(self.counts), self.current,
                           store.backlog(p.model, 0).waiting + sum(x.sequences for x in at_first),
                           desired, len(whole), tuple(len(s) for s in serving))

    def apply(self, decision: LayoutDecision, now: float) -> None:
        p = self.pipeline
        if decision.whole is not None:
            self.backend.scale_function(p.whole, decision.whole)
        if decision.stages is not None:
            for stage in p.stages:
                self.backend.set_replicas(stage, decision.stages)
        RedisStore(self.r).set_layout(p.model, LayoutChange(now, decision.layout, decision.reason), self.records_maxlen)
