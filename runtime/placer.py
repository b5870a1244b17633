"""Puts the scheduler's decisions into effect on the embedded runtime's virtual servers: reads
what each server holds (slots in use, zygotes, cold starts under way) and the key stages, asks
`scheduler.placement.Scheduler` where new replicas go and which ones leave, then starts (fork,
cold or peer) and drains them. Every decision is logged and added to the `quart:placements` stream.

λScale's execute-while-load (§4.3) and mode switch (§4.4): a whole-model replica that receives its
shards from peers gets, on its server, a stand-in replica of each of the model's stage functions,
following the same shards. The multicast sends a model's shards in a different order to each
sub-group (runtime/multicast.send_stage), so servers hold different whole shards early; each
stand-in serves once its shard is whole, and requests flow through the stage streams across
servers, a pipeline before any server holds the whole model. Once the whole replica is ready the
stand-ins on its server drain, handing their KV caches over as a consolidating pipeline does
(engine/batch_policy.handover_peer: to the wider replica, else a peer of their stage). Stand-ins
hold slots but are not their functions' own: the scheduler neither counts nor removes them."""
from __future__ import annotations

import logging
import time
from dataclasses import replace

from contracts.config import Settings
from contracts.stack import is_whole, ttft_slo_s
from keysmanager.client import KeysManagerError
from models.sizes import stage_bytes
from runtime.functions import FunctionState, ProcessManager, ReplicaProcess
from runtime.multicast import send_stage
from scheduler.coldstart import fetch_deadline_s
from scheduler.placement import Scheduler, SchedulerParams
from scheduler.state import Change, ClusterState, Fetch, PlacedReplica, Schedule, ServerView, cluster_state, fetches_under_way
from scheduler.state import Placement as Place
from state.records import Placement
from state.store import Store, after_fetch_s

log = logging.getLogger("quart.placer")


class Placer:
    def __init__(self, settings: Settings, processes: ProcessManager, store: Store,
                 scheduler: Scheduler | None = None) -> None:
        self.settings = settings
        self.processes = processes
        self.store = store
        self.scheduler = scheduler or Scheduler(SchedulerParams.from_settings(settings))
        self.servers = settings.virtual_server_names()
        self._bytes: dict[str, int] = {}
        self._unplaced: set[tuple[str, str]] = set()

    def converge(self, functions: list[FunctionState], draining: list[FunctionState]) -> Schedule | None:
        """One round: each function towards its desired replica count."""
        now = time.time()
        self._switch(functions)
        by_stage = {fn.stage_key: fn for fn in functions}
        deltas = {fn.name: fn.desired - len(fn.own()) for fn in functions}
        # A function whose last replicas exited before they were ready waits its back-off.
        moving = [fn for fn in functions if deltas[fn.name] and not (deltas[fn.name] > 0 and fn.retry_at > now)]
        if not moving:
            return None
        deadlines = {fn.name: self.deadline_s(fn, functions) for fn in functions}  # once a round: they read Redis
        changes = [Change(fn.stage_key, deltas[fn.name], self.shard_bytes(fn), deadlines[fn.name]) for fn in moving]
        schedule = self.scheduler.schedule(self.state(functions, draining, deadlines), changes)
        self._apply(schedule, by_stage)
        return schedule

    def shard_bytes(self, fn: FunctionState) -> int:
        """What a cold start of `fn` reads; 0 (and not remembered) for a model gone from disk,
        whose replicas will say so as they fail to start: one function must not stop placement."""
        if fn.stage_key not in self._bytes:
            stage = fn.stage
            try:
                self._bytes[fn.stage_key] = 0 if stage is None else \
                    stage_bytes(self.settings.models_dir, stage.model, stage.first, stage.last)
            except (FileNotFoundError, ValueError) as exc:
                log.warning("%s: %s", fn.name, exc)
                return 0
        return self._bytes[fn.stage_key]

    def deadline_s(self, fn: FunctionState, functions: list[FunctionState]) -> float:
        """How long a cold start of `fn` may take to fetch its shards: its model's TTFT objective
        (label com.quart.ttft-slo) less what follows the fetch, as measured; QUART_COLD_DEADLINE_S
        for a function without one."""
        fallback = self.settings.servers.cold_deadline_s
        slo = ttft_slo_s(fn.deployment.get("labels") or {}) if fn.stage is not None else None
        if slo is None:
            return fallback
        stages = [f.stage for f in functions if f.stage is not None and f.stage.model == fn.stage.model]
        return fetch_deadline_s(slo, after_fetch_s(self.store, fn.stage, stages), fallback)

    def state(self, functions: list[FunctionState], draining: list[FunctionState],
              deadlines: dict[str, float]) -> ClusterState:
        """What every server holds; `deadlines`: each function's fetch deadline (deadline_s)."""
        now = time.time()
        serving = [(fn, r) for fn in functions for r in fn.serving()]
        servers = []
        for name in self.servers:
            cached, held = self.store.cached_stages(name)
            cold = [(fn, r) for fn, r in serving if r.server == name and r.started_by == "cold" and not r.ready]
            servers.append(ServerView(name, self.settings.server_slots(), self.settings.servers.bandwidth, cached, held,
                                      self._fetches(cold, deadlines, now)))
        # Every replica of the functions deployed; of those an update replaced, the ones still draining.
        replicas = [_placed(fn, r) for fn in functions for r in fn.replicas] + \
                   [_placed(fn, r) for fn in draining for r in fn.replicas if r.draining_since is not None]
        store = self.settings.servers.store_bandwidth if self.settings.servers.own_disks else 0.0
        return cluster_state(servers, replicas, (s.key for s in self.store.key_stages()), now,
                             self.settings.servers.cache_bytes, store)

    def _fetches(self, cold: list[tuple[FunctionState, ReplicaProcess]], deadlines: dict[str, float],
                 now: float) -> tuple[Fetch, ...]:
        return fetches_under_way([(self.shard_bytes(fn), r.started) for fn, r in cold], self.settings.servers.bandwidth,
                                 self.settings.servers.cold_deadline_s, now, [deadlines[fn.name] for fn, _ in cold])

    def _apply(self, schedule: Schedule, by_stage: dict[str, FunctionState]) -> None:
        records = []
        for removal in schedule.removals:
            fn = by_stage[removal.stage]
            replica = next(r for r in fn.serving() if r.id == removal.replica)
            self.processes.drain(replica)
            records.append(Placement("remove", removal.stage, removal.reason, removal.server, replica=str(removal.replica)))
        placements = self._send_peers(schedule.placements, by_stage)
        for p in placements:
            replica = self.processes.spawn(by_stage[p.stage], p.server, p.path)
            replica.placement = p
            records.append(Placement("add", p.stage, p.reason, p.server, p.path, str(replica.id), replica.started_by,
                                     predicted_s=p.predicted_s))
            if p.path == "peer":
                records += self._stand_ins(by_stage[p.stage], replica, list(by_stage.values()))
        unplaced = set(schedule.unplaced)
        records += [Placement("unplaced", stage, why) for stage, why in unplaced - self._unplaced]
        self._unplaced = unplaced
        self._write([replace(record, contention=schedule.contention, t=time.time()) for record in records])

    def _send_peers(self, placements: tuple[Place, ...], by_stage: dict[str, FunctionState]) -> list[Place]:
        """Starts one multicast per stage with peer placements (each of its shards from the
        servers that cache it to the placements' servers); a stage whose multicast could not be
        started starts cold instead (a target that did start receiving a shard does not prefetch it
        too: its replica follows the reception)."""
        out = list(placements)
        for stage in dict.fromkeys(p.stage for p in placements if p.path == "peer"):
            mine = [i for i, p in enumerate(out) if p.stage == stage and p.path == "peer"]
            targets, holders = [out[i].server for i in mine], list(out[mine[0]].sources)
            try:
                send_stage(self.processes.keys, by_stage[stage].stage, holders, targets,
                           self.scheduler.params.peer_blocks, self.settings.models_dir)
            except (KeysManagerError, OSError, ValueError) as exc:
                log.warning("no multicast of %s to %s (%s); cold starts", stage, targets, exc)
                for i in mine:
                    out[i] = replace(out[i], path="cold", reason=f"{out[i].reason}; the multicast failed: {exc}")
        return out

    def _stand_ins(self, whole: FunctionState, replica: ReplicaProcess,
                   functions: list[FunctionState]) -> list[Placement]:
        """Execute-while-load: on `replica`'s server, a stand-in of each stage function of its
        model, where `whole` serves the whole model, its stage functions cover it shard by shard
        and none of them serves (a model running as its pipeline has no need of them); their
        placements."""
        if not self.settings.servers.execute_while_load or not is_whole(whole):
            return []
        parts = sorted((fn for fn in functions if fn.stage is not None and fn.stage.model == whole.stage.model
                        and not is_whole(fn)), key=lambda fn: fn.stage)
        if len(parts) < 2 or [i for fn in parts for i in fn.stage.indices()] != list(whole.stage.indices()) \
                or any(fn.own() for fn in parts):
            return []
        records = []
        for part in parts:
            stand_in = self.processes.spawn(part, replica.server, "peer")
            stand_in.stands_in_for = replica.id
            records.append(Placement("add", part.stage_key, f"execute-while-load: stands in for {whole.name} "
                                     f"{replica.id} while its shards arrive", replica.server, "peer",
                                     str(stand_in.id), stand_in.started_by))
        return records

    def _switch(self, functions: list[FunctionState]) -> None:
        """The mode switch: stand-ins whose whole replica is ready drain (their caches go to it),
        and so do those whose whole replica is gone or leaving."""
        whole = {r.id: r for fn in functions for r in fn.replicas}
        records = []
        for fn in functions:
            for r in fn.serving():
                if r.stands_in_for is None:
                    continue
                target = whole.get(r.stands_in_for)
                if target is None or target.draining_since is not None or target.ready:
                    self.processes.drain(r)
                    why = "mode switch: the whole replica is ready" if target is not None and target.ready \
                        else "the whole replica it stood in for is gone"
                    records.append(Placement("remove", fn.stage_key, why, r.server, replica=str(r.id), t=time.time()))
        self._write(records)

    def started(self, fn: FunctionState, replica: ReplicaProcess) -> None:
        """A replica is ready: how long its start took beside the scheduler's prediction, in
        `quart:placements` (op "ready")."""
        p, replica.placement = replica.placement, None
        if p is None:
            return
        took = time.time() - replica.started
        record = Placement("ready", fn.stage_key, f"ready {took:.2f} s after it was placed", p.server, p.path,
                           str(replica.id), replica.started_by, predicted_s=p.predicted_s, took_s=took, t=time.time())
        self._write([record])

    def exited(self, fn: FunctionState, reaped: list[ReplicaProcess]) -> None:
        """Replicas that exited without being asked to (a crash, a start that failed): op "exit"
        in `quart:placements`, with the exit code, so that the record of what ran where has no
        gaps (their logs say why)."""
        records = [Placement("exit", fn.stage_key, f"exited with code {r.proc.returncode}"
                             + ("" if r.ready else " before it was ready"), r.server, replica=str(r.id),
                             started_by=r.started_by, t=time.time())
                   for r in reaped if r.draining_since is None]
        self._write(records, logging.WARNING)

    def _write(self, records: list[Placement], level: int = logging.INFO) -> None:
        """Logs each record (one the scheduler could not place as a warning) and adds them to
        `quart:placements`."""
        for record in records:
            log.log(logging.WARNING if record.op == "unplaced" else level, "%s", record)
        if records:
            self.store.add_placements(records, self.settings.data.records_maxlen)


def _placed(fn: FunctionState, r: ReplicaProcess) -> tuple[PlacedReplica, bool]:
    """A replica as the scheduler sees it, and whether it is not the scheduler's to count or
    remove (it drains, or stands in for a whole replica: either way it holds its slot)."""
    return PlacedReplica(r.id, fn.stage_key, r.server, r.started_by, r.ready, r.started), \
        r.draining_since is not None or r.stands_in_for is not None
