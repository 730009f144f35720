"""Who writes what in a multi-rank save.

Each rank stores its ``local`` leaves (under a ``PerRank``) and the DTensor shards it holds
(``sharded``; of ranks holding the same shard, a replicated mesh dimension, only coordinate
0 writes). A ``replicated`` leaf (a plain tensor: DDP parameters, an optimizer's step count)
is the same on every rank and is written once, by the rank the plan gives it: largest first
onto the rank with the fewest bytes to write so far (sharded bytes counted), so the write
load is spread over the ranks.

Planning takes one collective on the training thread, on the first save of a state shape:
every rank's digest of what it saves (the names, dtypes and shapes of its replicated and
sharded leaves, and the key paths of its plain values outside ``PerRank``: the values
themselves are not compared) and its own byte count. Ranks that disagree (a rank-dependent
value not wrapped in ``PerRank``, a model built differently, a key only some ranks have) get
a ``StateError`` naming the first key that differs, on every rank alike. The plan is cached
by the state's layout key: later saves of the same state run no collective at all. A state whose
tensors are all ``PlacedShard``s (``integrations.dcp``: DCP's planner already decided who writes
each chunk and checked the ranks) is planned locally, without a collective.
"""

from __future__ import annotations

import hashlib
import heapq
from dataclasses import dataclass
from typing import Any

from mpckpt._codec.snapshot import FlatState
from mpckpt._codec.values import TAG, path_of
from mpckpt._dist.group import RankGroup
from mpckpt.errors import StateError

BLOCK_BYTES = 256 << 10  # each file's bytes are checksummed per block too (ranged reads verify; at most two
# partial blocks are read beyond a range: 256 KiB keeps that small, and 4,096 checksums per GiB in the skeleton)


@dataclass(frozen=True)
class RankPlan:
    skip: frozenset[int]       # leaves this rank does not write
    writer: dict[int, int]     # replicated leaf -> the rank that writes it


class Planner:
    """The plans of the last few state shapes one rank saved."""

    SIZE = 8

    def __init__(self, group: RankGroup) -> None:
        self.group = group
        self._plans: dict[Any, RankPlan] = {}

    def plan(self, flat: FlatState) -> RankPlan:
        if flat.dist is not None and flat.dist.placed:  # the caller placed every tensor (DCP's planner did)
            return RankPlan(frozenset(i for i, s in flat.dist.shards.items() if not s.writes), {})
        plan = self._plans.get(flat.key)
        if plan is None:
            plan = self._agree(flat)
            if len(self._plans) >= self.SIZE:
                self._plans.pop(next(iter(self._plans)))
            self._plans[flat.key] = plan
        return plan

    def _agree(self, flat: FlatState) -> RankPlan:
        assert flat.dist is not None
        kinds, shards = flat.dist.kinds, flat.dist.shards
        replicated = [i for i, k in enumerate(kinds) if k == "replicated"]
        own = sum(leaf.nbytes for i, leaf in enumerate(flat.leaves)
                  if kinds[i] == "local" or (kinds[i] == "sharded" and shards[i].writes))
        signature = _signature(flat)
        gathered = self.group.all_gather((_digest(signature), own))
        if len({digest for digest, _ in gathered}) > 1:
            self._disagree(signature, [digest for digest, _ in gathered])
        loads = [(bytes_, rank) for rank, (_, bytes_) in enumerate(gathered)]
        heapq.heapify(loads)
        writer: dict[int, int] = {}
        for i in sorted(replicated, key=lambda i: (-flat.leaves[i].nbytes, flat.leaves[i].name)):
            load, rank = heapq.heappop(loads)
            writer[i] = rank
            heapq.heappush(loads, (load + flat.leaves[i].nbytes, rank))
        me = self.group.rank
        skip = frozenset([i for i in replicated if writer[i] != me]
                         + [i for i, s in shards.items() if not s.writes])
        return RankPlan(skip, writer)

    def _disagree(self, signature: list[tuple[Any, ...]], digests: list[str]) -> None:
        """Ranks save different states: a second collective finds the first key that differs
        (compared by name, so that a key one rank lacks does not shift the comparison of the rest)."""
        every = self.group.all_gather(signature)
        base = {entry[0]: entry for entry in every[0]}
        hint = "Every rank must save the same keys with the same shapes; wrap values that differ per rank in " \
               "mpckpt.PerRank(...)"
        for rank, sig in enumerate(every):
            if sig == every[0]:
                continue
            theirs = {entry[0]: entry for entry in sig}
            for name, mine in base.items():
                other = theirs.get(name)
                if other is not None and other != mine:
                    raise StateError(f"the ranks save different states: rank 0 has {_show(mine)}, rank {rank} has "
                                     f"{_show(other)}. {hint}", key=str(name))
            for name, mine in base.items():
                if name not in theirs:
                    raise StateError(f"the ranks save different states: rank 0 has {_show(mine)}, rank {rank} has no "
                                     f"{name!r}. {hint}", key=str(name))
            for name, other in theirs.items():
                if name not in base:
                    raise StateError(f"the ranks save different states: rank {rank} has {_show(other)}, rank 0 has no "
                                     f"{name!r}. {hint}", key=str(name))
            first = next((a for a, b in zip(every[0], sig, strict=False) if a != b), (every[0] or sig)[0])
            raise StateError(f"the ranks save the same keys in another order: from {first[0]!r} on, rank 0 and rank "
                             f"{rank} differ. {hint}", key=str(first[0]))


def _signature(flat: FlatState) -> list[tuple[Any, ...]]:
    """What every rank must agree on: each non-local leaf's name, kind, dtype and (global) shape,
    then the key path of each plain value outside a ``PerRank`` (not the value: only its place)."""
    assert flat.dist is not None
    out: list[tuple[Any, ...]] = []
    for i, leaf in enumerate(flat.leaves):
        kind = flat.dist.kinds[i]
        if kind == "local":
            continue
        shape = flat.dist.shards[i].global_shape if kind == "sharded" else leaf.shape
        out.append((leaf.name, kind, leaf.code, tuple(shape)))
    out.extend((path, "value", "", ()) for path in _value_paths(flat.tree, ""))
    return out


def _value_paths(node: Any, path: str) -> list[str]:
    """The key paths of the plain values in skeleton tree ``node`` (tensors and PerRank values left out)."""
    if isinstance(node, list):
        return [p for i, x in enumerate(node) for p in _value_paths(x, path_of(path, i))]
    if not isinstance(node, dict):
        return [path]
    tag = node.get(TAG)
    if tag in ("tensor", "per_rank"):
        return []
    keys, values = node.get("k"), node.get("v")
    if isinstance(keys, list) and isinstance(values, list) and len(keys) == len(values):  # dict, odict, dataclass ...
        return [p for k, v in zip(keys, values, strict=True) for p in _value_paths(v, path_of(path, k))]
    if isinstance(values, list):  # tuple, set ...
        return [p for i, x in enumerate(values) for p in _value_paths(x, path_of(path, i))]
    return [path]  # one value (a float that is not finite, bytes, a dtype ...)


def _digest(signature: list[tuple[Any, ...]]) -> str:
    return hashlib.sha256(repr(signature).encode()).hexdigest()


def _show(entry: tuple[Any, ...]) -> str:
    name, kind, code, shape = entry
    if kind == "value":
        return f"{name!r} (a value)"
    return f"{name!r} ({kind}, {code}, shape {list(shape)})"
