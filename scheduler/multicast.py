"""How servers that hold a stage send it on to the servers that need it (λScale §4.2): rounds of
block transfers in which every server sends at most one block and receives at most one, so that
every link works at once instead of every target reading from one source.

- `plan(holders, targets, blocks)`: λScale's k-way binomial pipeline. The servers are divided into
  k sub-groups, one per holder (`subgroups`); each holder's sub-group is a binomial pipeline (a
  hypercube in which the holder releases one block a round and every server passes on the newest
  block its neighbour lacks, `binomial_rounds`), and sub-group i releases the blocks in the order
  of λScale's Algorithm 1 (`chunk_orders`), so that different sub-groups hold different parts of
  the model early and can answer together as a pipeline (`execution_pipelines`, Algorithm 2).
  One holder and N servers in all take b + ⌈log₂N⌉ − 1 rounds when N is a power of two, the
  optimum for one-port links; otherwise the hypercube of the next power of two has empty corners
  and the best of a few placements of the servers in it is taken (one round more at most for
  N ≤ 64, `tests/unit/test_multicast.py`).
- `binary_tree_plan` and `unicast_plan`: FaaSNet's binary tree and one source sending to each
  target in turn, the baselines λScale is measured against.
- `elbow_blocks`: the block count past which more blocks gain little (λScale §7.6's elbow), from
  measured multicast times.

A round moves one block over each busy link, so a plan of R rounds of blocks of M/b bytes takes
R·M/(b·B) seconds on links of B bytes/s (`MulticastPlan.seconds`). Pure: names in, a plan out."""
from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# Placements of a group's servers in the hypercube's corners tried when its size is not a power
# of two (the first is the fixed order below; the others seeded shuffles, so the plan is the same
# every time).
PLACEMENT_TRIES = 8
# λScale §7.6: the elbow is where one more doubling of the blocks gains less than this.
ELBOW_GAIN = 0.1


@dataclass(frozen=True)
class Transfer:
    source: str
    target: str
    block: int


@dataclass(frozen=True)
class MulticastPlan:
    blocks: int
    groups: tuple[tuple[str, ...], ...]        # each sub-group: its holder first, then its targets
    orders: tuple[tuple[int, ...], ...]        # the order each sub-group's holder releases the blocks in
    rounds: tuple[tuple[Transfer, ...], ...]

    def seconds(self, stage_bytes: float, bandwidth: float) -> float:
        """The plan's time on links of `bandwidth` bytes/s each way: a block a round."""
        return len(self.rounds) * stage_bytes / self.blocks / bandwidth

    def complete_after(self) -> dict[str, int]:
        """Each target's round (1-based) by whose end it holds every block."""
        count: dict[str, int] = {}
        done: dict[str, int] = {}
        for index, transfers in enumerate(self.rounds, 1):
            for t in transfers:
                count[t.target] = count.get(t.target, 0) + 1
                if count[t.target] == self.blocks:
                    done[t.target] = index
        return done


def block_pieces(pieces: int, blocks: int, block: int) -> tuple[int, int]:
    """The pieces [first, end) that block `block` of `blocks` covers in a shard of `pieces`
    hashed pieces (models/manifest.PIECE_BYTES each): runs as even as whole pieces allow."""
    if not 1 <= blocks <= pieces:
        raise ValueError(f"a shard of {pieces} pieces is sent in 1 to {pieces} blocks, not {blocks}")
    if not 0 <= block < blocks:
        raise ValueError(f"block {block} is not one of {blocks}")
    return block * pieces // blocks, (block + 1) * pieces // blocks


def chunk_orders(k: int, blocks: int) -> list[list[int]]:
    """λScale's Algorithm 1: the blocks cut into k chunks of ⌈b/k⌉, and sub-group i's order the
    chunks circularly shifted by i, so the sub-groups' first blocks differ."""
    size = math.ceil(blocks / k)
    chunks = [list(range(size * i, min(size * (i + 1), blocks))) for i in range(k)]
    return [[block for j in range(k) for block in chunks[(i + j) % k]] for i in range(k)]


def subgroups(holders: Sequence[str], targets: Sequence[str]) -> list[list[str]]:
    """The N servers divided into one sub-group per holder, as evenly as they go (λScale: each of
    ⌊N/k⌋ servers, the remainder spread), each holder first, the targets in the order given."""
    if not holders:
        raise ValueError("a multicast needs at least one holder")
    k = len(holders)
    groups = [[h] for h in holders]
    for index, target in enumerate(targets):
        groups[index % k].append(target)
    return groups


def binomial_rounds(n: int, order: Sequence[int]) -> list[list[tuple[int, int, int]]]:
    """The binomial pipeline over n servers (0 holds every block; 1..n-1 none), blocks released
    in `order`: rounds of (source, target, block), each server sending one and receiving one a
    round at most. The fewest rounds over a few placements of the servers in the hypercube."""
    if n < 2:
        return []
    best: list[list[tuple[int, int, int]]] | None = None
    for corners in _placements(n):
        rounds = _hypercube(corners, list(order))
        if best is None or len(rounds) < len(best):
            best = rounds
    return best


def _placements(n: int) -> list[list[int]]:
    """Where servers 0..n-1 sit among the 2^d corners: 0 and its d neighbours always (they take
    the holder's first blocks), then the other corners, fullest first."""
    d = max(1, math.ceil(math.log2(n)))
    if n == 1 << d:
        return [list(range(n))]
    fixed = [0] + [1 << i for i in range(d)]
    rest = sorted((c for c in range(1, 1 << d) if c & (c - 1)), key=lambda c: (-bin(c).count("1"), c))
    tries = [fixed + rest]
    rng = random.Random(n)
    for _ in range(PLACEMENT_TRIES - 1):
        rng.shuffle(rest)
        tries.append(fixed + rest)
    return [t[:n] for t in tries]


def _hypercube(corners: list[int], order: list[int]) -> list[list[tuple[int, int, int]]]:
    """Round t pairs the servers across dimension t mod d: the holder sends the t-th block of
    `order` (later, the newest its neighbour lacks), every other server the newest block its
    neighbour lacks ("newest" by position in `order`). A server whose corner's neighbour is
    empty, or that has nothing its neighbour lacks, is free that round: free servers that lack
    blocks take the newest they can from a free server that has it."""
    n, b = len(corners), len(order)
    d = max(1, math.ceil(math.log2(n)))
    rank = {block: i for i, block in enumerate(order)}
    at = {corner: server for server, corner in enumerate(corners)}
    have: list[set[int]] = [set(order)] + [set() for _ in range(n - 1)]
    rounds: list[list[tuple[int, int, int]]] = []
    while any(len(h) < b for h in have):
        t = len(rounds)
        moves: list[tuple[int, int, int]] = []
        sending: set[int] = set()
        receiving: set[int] = set()
        for x in range(n):
            partner = at.get(corners[x] ^ (1 << (t % d)))
            lack = have[x] - have[partner] if partner is not None else set()
            if not lack:
                continue
            block = order[t] if x == 0 and t < b and order[t] in lack else max(lack, key=rank.__getitem__)
            moves.append((x, partner, block))
            sending.add(x)
            receiving.add(partner)
        for target in sorted((r for r in range(n) if r not in receiving and len(have[r]) < b),
                             key=lambda r: (len(have[r]), r)):
            offers = [(max(have[s] - have[target], key=rank.__getitem__), s) for s in range(n)
                      if s not in sending and s != target and have[s] - have[target]]
            if offers:
                block, source = max(offers, key=lambda o: (rank[o[0]], -o[1]))
                moves.append((source, target, block))
                sending.add(source)
                receiving.add(target)
        for _, target, block in moves:
            have[target].add(block)
        rounds.append(moves)
    return rounds


def plan(holders: Sequence[str], targets: Sequence[str], blocks: int) -> MulticastPlan:
    """λScale's k-way multicast of a stage cut into `blocks` blocks from k = len(holders) servers
    to `targets`: the sub-groups' binomial pipelines run side by side, round for round."""
    if blocks < 1:
        raise ValueError(f"a stage is sent in at least one block, not {blocks}")
    overlap = set(holders) & set(targets)
    if overlap or len(set(targets)) != len(targets) or len(set(holders)) != len(holders):
        raise ValueError(f"holders and targets must be distinct servers (both: {sorted(overlap)})")
    groups = subgroups(holders, targets)
    orders = chunk_orders(len(groups), blocks)
    merged: list[list[Transfer]] = []
    for group, order in zip(groups, orders):
        for index, moves in enumerate(binomial_rounds(len(group), order)):
            if index == len(merged):
                merged.append([])
            merged[index] += [Transfer(group[s], group[t], block) for s, t, block in moves]
    return MulticastPlan(blocks, tuple(tuple(g) for g in groups), tuple(tuple(o) for o in orders),
                         tuple(tuple(r) for r in merged))


@dataclass(frozen=True)
class Step:
    """One pull of a target's part of a plan: the block, from whom, in which round, and the round
    of that source's send before it (-1 for its first), which the source sends first."""
    source: str
    block: int
    round: int
    after: int


def pulls_by_target(p: MulticastPlan) -> dict[str, list[Step]]:
    """Each target's part of the plan, as it executes it: its pulls in round order."""
    out: dict[str, list[Step]] = {t: [] for g in p.groups for t in g[1:]}
    last_send: dict[str, int] = {}
    for index, transfers in enumerate(p.rounds):
        for t in transfers:
            out[t.target].append(Step(t.source, t.block, index, last_send.get(t.source, -1)))
        for t in transfers:
            last_send[t.source] = index
    return out


def binary_tree_plan(holder: str, targets: Sequence[str], blocks: int) -> MulticastPlan:
    """FaaSNet's binary tree (holder at the root, server i's children 2i+1 and 2i+2 in the order
    given), one block a round per link: each parent alternates its two children, sending each the
    next block in order that it has and the child lacks."""
    names = [holder, *targets]
    n = len(names)
    have = [blocks] + [0] * (n - 1)  # servers receive in order: a count is the prefix held
    turn = [0] * n
    rounds: list[tuple[Transfer, ...]] = []
    while min(have) < blocks:
        moves = []
        for parent in range(n):
            children = [c for c in (2 * parent + 1, 2 * parent + 2) if c < n and have[c] < have[parent]]
            if children:
                child = children[turn[parent] % len(children)]
                turn[parent] += 1
                moves.append(Transfer(names[parent], names[child], have[child]))
        for move in moves:
            have[names.index(move.target)] += 1
        rounds.append(tuple(moves))
    return MulticastPlan(blocks, (tuple(names),), (tuple(range(blocks)),), tuple(rounds))


def unicast_plan(holder: str, targets: Sequence[str], blocks: int) -> MulticastPlan:
    """One holder sending the whole stage to each target in turn, a block a round."""
    rounds = tuple((Transfer(holder, target, block),) for target in targets for block in range(blocks))
    return MulticastPlan(blocks, ((holder, *targets),), (tuple(range(blocks)),), rounds)


def binary_tree_rounds(n: int, blocks: int) -> int:
    return len(binary_tree_plan("0", [str(i) for i in range(1, n)], blocks).rounds)


def unicast_rounds(n: int, blocks: int) -> int:
    return (n - 1) * blocks


def lower_bound_rounds(n: int, blocks: int) -> int:
    """λScale's b + ⌈log₂N⌉ − 1 for one holder among n servers: the last block leaves the holder
    in round b, and the servers holding it at most double every round after."""
    return blocks + math.ceil(math.log2(n)) - 1 if n > 1 else 0


def elbow_blocks(seconds: Mapping[int, float], gain: float = ELBOW_GAIN) -> int:
    """The fewest blocks past which doubling gains less than `gain` of the time (λScale §7.6),
    from measured multicast times by block count. More blocks mean more hops for a pipeline's
    activations, so the smallest count on the flat part is the one to use."""
    counts = sorted(seconds)
    if not counts:
        raise ValueError("no measured block counts")
    for here, there in zip(counts, counts[1:]):
        if seconds[there] > seconds[here] * (1 - gain):
            return here
    return counts[-1]


def execution_pipelines(groups: Sequence[Sequence[str]]) -> list[list[str]]:
    """λScale's Algorithm 2: the targets of the k sub-groups (holders left out) formed into
    pipelines across sub-groups, one server from each sub-group that still has one per pipeline
    (they received different blocks first), as many as the smallest has; when one sub-group is
    left, its remaining servers form one pipeline."""
    left = [list(g) for g in groups if g]
    pipelines: list[list[str]] = []
    while left:
        if len(left) == 1:
            pipelines.append(left.pop())
            break
        depth = min(len(g) for g in left)
        pipelines += [[g[t] for g in left] for t in range(depth)]
        left = [g[depth:] for g in left if len(g) > depth]
    return pipelines
