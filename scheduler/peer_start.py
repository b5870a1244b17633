"""λScale's locality-driven start (§5): of one round's placements that cannot fork (their server
holds no zygote of the stage), which read the stage from the model store (cold) and which receive
it from the servers that hold it (peer), by predicted completion time.

- cold: each target reads the stage's M bytes from the store, and every cold read of the round
  shares the store's link (HydraServe's contention rule, Eq. 3); no target reads faster than its
  own link B: max(M/B, all the round's cold bytes / B_store).
- peer: the k servers that cache the stage send it to the n targets by λScale's k-way binomial
  pipeline of b blocks (scheduler/multicast.py): R(n, k, b)·M/(b·B), B the slowest server's link,
  times the number of stages its busiest holder sends in the round (they share its uplink).

A stage's targets in a round go one way together (one multicast per stage and round). Greedy, the
stages with the most bytes to move first: each becomes a peer start where that is sooner than the
store with the stages chosen before it (their bytes off the store, their sends on their holders'
links). Pure: the schedule's placements in, the same placements with their path,
sources and prediction out."""
from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict

from scheduler.multicast import plan
from scheduler.state import ClusterState, Placement


def cold_seconds(stage_bytes: float, store_bytes: float, link: float, store: float) -> float:
    """A read of `stage_bytes` from a store of `store` bytes/s whose link carries `store_bytes` in all."""
    return max(stage_bytes / link, store_bytes / store)


def peer_seconds(stage_bytes: float, holders: list[str], targets: list[str], link: float, blocks: int) -> float:
    """λScale's multicast of the stage from `holders` to `targets` on links of `link` bytes/s."""
    return plan(holders, targets, blocks).seconds(stage_bytes, link)


def choose_sources(placements: tuple[Placement, ...], state: ClusterState, stage_bytes: dict[str, float],
                   blocks: int, peers: bool = True) -> tuple[Placement, ...]:
    """`placements` with each stage's cold ones made peer starts where its holders would finish
    sooner than the store (never without `peers`); every cold or peer placement carries its
    predicted seconds. Where servers read their own disks (`state.store_bandwidth` 0) nothing
    changes."""
    if state.store_bandwidth <= 0:
        return placements
    targets: dict[str, list[str]] = defaultdict(list)
    for p in placements:
        if p.path == "cold":
            targets[p.stage].append(p.server)
    links = {s.name: s.bandwidth for s in state.servers}
    holders = {stage: sorted(s.name for s in state.servers if peers and stage in s.cached and s.name not in servers)
               for stage, servers in targets.items()}
    store_bytes = sum(stage_bytes.get(stage, 0.0) * len(servers) for stage, servers in targets.items())
    load: Counter[str] = Counter()  # stages each holder sends this round

    def seconds(stage: str, path: str) -> float:
        size, servers, mine = stage_bytes.get(stage, 0.0), targets[stage], holders[stage]
        link = min(links[s] for s in [*servers, *mine])
        if path == "cold":
            return cold_seconds(size, store_bytes, link, state.store_bandwidth)
        return peer_seconds(size, mine, servers, link, blocks) * max(load[h] for h in mine)

    peer_stages = []
    for stage in sorted(targets, key=lambda st: -stage_bytes.get(st, 0.0) * len(targets[st])):  # most bytes first
        if not holders[stage] or stage_bytes.get(stage, 0.0) <= 0:
            continue
        cold = seconds(stage, "cold")
        load.update(holders[stage])
        if seconds(stage, "peer") < cold:
            peer_stages.append(stage)
            store_bytes -= stage_bytes[stage] * len(targets[stage])
        else:
            load.subtract(holders[stage])
    choice = {stage: ("peer", seconds(stage, "peer"), tuple(holders[stage])) if stage in peer_stages
              else ("cold", seconds(stage, "cold"), ()) for stage in targets}
    out = []
    for p in placements:
        if p.path != "cold":
            out.append(p)
            continue
        path, predicted, sources = choice[p.stage]
        why = f"from {', '.join(sources)}" if sources else "from the model store"
        out.append(dataclasses.replace(p, path=path, predicted_s=predicted, sources=sources,
                                       reason=f"{p.reason}; {path} {why}, {predicted:.2f} s predicted"))
    return tuple(out)
