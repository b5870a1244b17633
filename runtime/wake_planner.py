"""What the embedded runtime knows when a model wakes from zero, for the choice of its layout
(scheduler/wake_layout.py): the costs its earlier cold starts and passes measured, its bytes, its
TTFT objective, and the runtime's servers as the scheduler sees them (the bandwidth each fetches
at, whether it has a free slot)."""
from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable

from contracts.config import Settings
from contracts.stack import is_whole, least_ttft_slo_s
from runtime.functions import FunctionState
from scheduler.coldstart import ColdServer
from scheduler.wake_layout import WakeChoice, choose
from state.store import Store, cold_start_costs


class WakePlanner:
    def __init__(self, settings: Settings, store: Store, shard_bytes: Callable[[FunctionState], int]) -> None:
        """`shard_bytes(fn)`: what a cold start of `fn` reads (the placer's, which remembers it)."""
        self.settings, self.store, self.shard_bytes = settings, store, shard_bytes

    def __call__(self, model: str, functions: list[FunctionState]) -> WakeChoice:
        """Algorithm 1's choice between the model's whole function and its stage functions.
        ValueError where no server has a free slot."""
        stage_fns = [fn for fn in functions if fn.stage is not None and fn.stage.model == model and not is_whole(fn)]
        costs, load_rate = cold_start_costs(self.store, [fn.stage for fn in stage_fns])
        objective = least_ttft_slo_s(fn.deployment.get("labels") or {} for fn in stage_fns)
        # The virtual servers share this host's cores: s workers import their libraries s times on them.
        return choose(costs, sum(self.shard_bytes(fn) for fn in stage_fns), self.servers(functions, load_rate),
                      len(stage_fns), objective, shared_cores=len(os.sched_getaffinity(0)))

    def servers(self, functions: list[FunctionState], load_rate: float) -> list[ColdServer]:
        used = Counter(r.server for fn in functions for r in fn.serving())
        slots = self.settings.server_slots()
        return [ColdServer(name, self.settings.servers.bandwidth, load_rate, fits_full=used[name] < slots)
                for name in self.settings.virtual_server_names()]
