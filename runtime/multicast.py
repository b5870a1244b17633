"""Runs a λScale multicast of one shard, or of a stage's several shards as one model, across
servers' KeysManagers: a plan from scheduler/multicast.py (λScale's, or a baseline's), each
target's part of it posted to its KeysManager as a schedule of pulls (keysmanager/blocks.py),
which the targets then execute among themselves, each pulling its blocks from the peers the plan
names (waiting for a peer that has yet to receive one) and from the holders where a peer does not
answer."""
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
    return start_shards(clients, p, model, [info])


def start_shards(clients: Mapping[str, KeysClient], p: MulticastPlan, model: str,
                 infos: Sequence[StageInfo]) -> MulticastPlan:
    """Starts plan `p` over the blocks of several shards taken as one model, in order, p.blocks /
    len(infos) blocks each (block j: block j mod that of shard j div that). As λScale multicasts a
    model, so that with k holders sub-group i receives the i-th part of it first (Algorithm 1) and
    different servers hold different shards whole early; under one plan id, so that each server
    sends its blocks of every shard in the plan's rounds' order."""
    per, rest = divmod(p.blocks, len(infos))
    if rest or not per:
        raise ValueError(f"a plan of {p.blocks} blocks does not split evenly over {len(infos)} shards")
    fallbacks = [clients[group[0]].url for group in p.groups]
    plan_id = uuid.uuid4().hex
    for target, steps in pulls_by_target(p).items():
        pulls: dict[int, list[dict]] = {}  # per shard, in the order the target first needs each
        for step in steps:
            index, block = divmod(step.block, per)
            first, end = block_pieces(len(infos[index].pieces), per, block)
            turn = Turn(plan_id, step.round, step.after)
            pulls.setdefault(index, []).append(Pull(clients[step.source].url, first, end, turn).to_json())
        for index, shard_pulls in pulls.items():
            clients[target].receive(model, infos[index].shard, shard_pulls, fallbacks)
    return p


def send_stage(clients: Mapping[str, KeysClient], stage: StageRef, holders: Sequence[str], targets: Sequence[str],
               blocks: int, models_dir: Path) -> MulticastPlan:
    """A peer start (λScale §5): `stage`'s shards multicast from `holders` to `targets` as one
    plan of about `blocks` blocks (⌈blocks / shards⌉ a shard), by the manifest in `models_dir`
    (the store's); the targets' replicas follow the shards as they arrive."""
    manifest = Manifest.load(models_dir / stage.model)
    infos = [manifest.stages[i] for i in stage.indices()]
    per = min(-(-blocks // len(infos)), *(len(info.pieces) for info in infos))
    return start_shards(clients, plan(holders, targets, per * len(infos)), stage.model, infos)


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
