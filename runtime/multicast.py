"""Runs a λScale multicast of one shard across servers' KeysManagers: a plan from
scheduler/multicast.py (λScale's, or a baseline's), each target's part of it posted to its KeysManager as a schedule of pulls
(keysmanager/blocks.py), which the targets then execute among themselves, each pulling its blocks
from the peers the plan names (waiting for a peer that has yet to receive one) and from the
holders where a peer does not answer."""
from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

from contracts.stage import StageRef
from keysmanager.blocks import Pull, Turn
from keysmanager.client import KeysClient
from models.manifest import Manifest, StageInfo
from scheduler.multicast import MulticastPlan, block_pieces, plan, pulls_by_target


def start(clients: Mapping[str, KeysClient], p: MulticastPlan, model: str, info: StageInfo) -> MulticastPlan:
    """Starts every target's part of plan `p` for `info`'s shard (servers named as in `clients`);
    the plan's holders are every target's fallbacks."""
    fallbacks = [clients[group[0]].url for group in p.groups]
    plan_id = uuid.uuid4().hex
    for target, steps in pulls_by_target(p).items():
        pulls = []
        for step in steps:
            first, end = block_pieces(len(info.pieces), p.blocks, step.block)
            pulls.append(Pull(clients[step.source].url, first, end, Turn(plan_id, step.round, step.after)).to_json())
        clients[target].receive(model, info.shard, pulls, fallbacks)
    return p


def send_stage(clients: Mapping[str, KeysClient], stage: StageRef, holders: Sequence[str], targets: Sequence[str],
               blocks: int, models_dir: Path) -> list[MulticastPlan]:
    """A peer start (λScale §5): each shard of `stage` multicast from `holders` to `targets` in
    `blocks` blocks, by the manifest in `models_dir` (the store's); the targets' replicas follow
    the shards as they arrive. A stage of several shards sends them one after another (each its own
    plan, started at once: every server's link serves its rounds in order)."""
    manifest = Manifest.load(models_dir / stage.model)
    return [start(clients, plan(holders, targets, blocks), stage.model, manifest.stages[i]) for i in stage.indices()]


def wait(clients: Mapping[str, KeysClient], targets: Sequence[str], shard: str, timeout_s: float) -> dict[str, dict]:
    """Each target's reception of `shard` once none is still receiving (or at the timeout); a
    target whose KeysManager does not answer is {"state": "unreachable"}."""
    deadline = time.monotonic() + timeout_s
    while True:
        views = {t: _reception(clients[t], shard) for t in targets}
        if all(v.get("state") in ("done", "failed", "unreachable") for v in views.values()) or time.monotonic() > deadline:
            return views
        time.sleep(0.05)


def _reception(client: KeysClient, shard: str) -> dict:
    try:
        return next((r for r in client.receptions() if r["shard"] == shard), {})
    except OSError:
        return {"state": "unreachable"}
