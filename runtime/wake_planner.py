"""What the embedded runtime knows when a model wakes from zero, for the choice of its layout
(scheduler/wake_layout.py): the costs its earlier cold starts and passes measured, its bytes, its
TTFT objective, and the runtime's servers as the scheduler sees them (the bandwidth each fetches
at, whether it has a free slot)."""
from __future__ import annotations

import os
import statistics
from collections import Counter
from collections.abc import Callable

from contracts.config import Settings
from contracts.stack import is_whole, ttft_slo_s
from contracts.stage import StageRef
from runtime.functions import FunctionState
from scheduler.coldstart import ColdServer, ColdStartCosts
from scheduler.wake_layout import WakeChoice, choose
from state.store import Store, pass_s


class WakePlanner:
    def __init__(self, settings: Settings, store: Store, shard_bytes: Callable[[FunctionState], int]) -> None:
        """`shard_bytes(fn)`: what a cold start of `fn` reads (the placer's, which remembers it)."""
        self.settings, self.store, self.shard_bytes = settings, store, shard_bytes

    def __call__(self, model: str, functions: list[FunctionState]) -> WakeChoice:
        """Algorithm 1's choice between the model's whole function and its stage functions.
        ValueError where no server has a free slot."""
        stage_fns = [fn for fn in functions if fn.stage is not None and fn.stage.model == model and not is_whole(fn)]
        costs, load_rate = measured_costs(self.store, [fn.stage for fn in stage_fns])
        objectives = [s for fn in stage_fns if (s := ttft_slo_s(fn.deployment.get("labels") or {})) is not None]
        # The virtual servers share this host's cores: s workers import their libraries s times on them.
        return choose(costs, sum(self.shard_bytes(fn) for fn in stage_fns), self.servers(functions, load_rate),
                      len(stage_fns), min(objectives, default=None), shared_cores=len(os.sched_getaffinity(0)))

    def servers(self, functions: list[FunctionState], load_rate: float) -> list[ColdServer]:
        used = Counter(r.server for fn in functions for r in fn.serving())
        slots = self.settings.server_slots()
        return [ColdServer(name, self.settings.servers.bandwidth, load_rate, fits_full=used[name] < slots)
                for name in self.settings.virtual_server_names()]


def measured_costs(store: Store, stages: list[StageRef]) -> tuple[ColdStartCosts, float]:
    """HydraServe's costs from the stages' latest cold starts and records, and the rate (bytes/s)
    fetched bytes became weights at after the fetch (infinite where loading kept up with it).
    Unmeasured, and taken as 0: process creation before the interpreter runs (either layout pays
    it) and the hops between stages (milliseconds, where the choice turns on seconds of fetch)."""
    colds = [c for s in stages if (c := store.cold_start(s)) is not None]
    imports = [c.imported_at - c.process_at for c in colds if c.imported_at and c.process_at]
    loading = sum(c.load_after_fetch_s for c in colds if c.bytes)
    load_rate = sum(c.bytes for c in colds) / loading if loading > 0 else float("inf")
    costs = ColdStartCosts(create_s=0.0, libraries_s=statistics.median(imports) if imports else 0.0,
                           prefill_s=pass_s(store, stages, "prefill"), decode_s=pass_s(store, stages, "decode"), hop_s=0.0)
    return costs, load_rate
