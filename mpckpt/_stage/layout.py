"""Plan where every tensor goes: waves of shared memory, shard files, byte offsets.

A *wave* is what one shared-memory slab holds at a time. A state that fits the memory
budget is one wave; a larger one is cut into waves of at most half the budget, so one wave
can be copied while the previous is written (double buffering). A tensor larger than a wave
is stored as consecutive flat chunks (``name#0``, ``name#1`` ...), each a valid safetensors
entry; the skeleton says how to join them.

Inside a wave the pieces are spread over one shard file per uploader with the
longest-processing-time rule (largest first onto the least loaded shard) so the uploaders
finish together. Inside a shard pieces are ordered by element size, largest first: every
piece then starts at an offset aligned to its own element size, which lets the copy view the
slab as the tensor's dtype, and the file needs no padding (safetensors allows no holes).

A layout depends only on names, dtypes and shapes, so it is computed once and reused for
every save of the same state; so are the tensor views into each slab.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Any

from mpckpt.format.safetensors import ITEMSIZE, HeaderEntry, build_header

_LAYOUT_IDS = itertools.count()
SHARD_ALIGN = 4096  # shard data starts on a page in the slab and on a block in the file (direct I/O)
MIN_WAVE_BYTES = 1 << 20


@dataclass
class Piece:
    leaf: int
    key: str
    code: str
    shape: tuple[int, ...]   # shape as stored (flat for chunks)
    chunk: tuple[int, int] | None  # flat element range of the leaf, or None for the whole leaf
    nbytes: int
    offset: int = 0          # in the wave's region

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.code]


@dataclass
class ShardPlan:
    filename: str
    pieces: list[Piece]
    frozen: bool = False     # holds only frozen leaves: may be referenced instead of rewritten
    offset: int = 0          # in the wave's region
    nbytes: int = 0
    header: bytes = b""


@dataclass
class WavePlan:
    shards: list[ShardPlan]
    nbytes: int = 0          # slab bytes this wave needs

    @property
    def pieces(self) -> list[Piece]:
        """Every piece of the wave in shard order (the order of the slab views), listed once."""
        pieces = self.__dict__.get("_pieces")
        if pieces is None:
            pieces = self.__dict__["_pieces"] = [p for s in self.shards for p in s.pieces]
        return pieces

    @property
    def copy_plan(self) -> list[tuple[int, tuple[int, int] | None]]:
        """(leaf, chunk) of every piece, in shard order (the order of the slab views)."""
        plan = self.__dict__.get("_copy_plan")
        if plan is None:
            plan = [(p.leaf, p.chunk) for s in self.shards for p in s.pieces]
            self.__dict__["_copy_plan"] = plan
        return plan

    @property
    def whole_leaves(self) -> list[int] | None:
        """The leaf of every piece in slab-view order, when no piece is a chunk of a leaf."""
        if "_whole_leaves" not in self.__dict__:
            plan = self.copy_plan
            self.__dict__["_whole_leaves"] = None if any(c is not None for _, c in plan) else [i for i, _ in plan]
        return self.__dict__["_whole_leaves"]


@dataclass
class Layout:
    waves: list[WavePlan]
    nbytes: int
    # leaf index -> [(filename, key, chunk start, chunk end)], for the skeleton
    parts: dict[int, list[tuple[str, str, int, int]]] = field(default_factory=dict)
    key: int = field(default_factory=lambda: next(_LAYOUT_IDS))  # unique, unlike id()

    @property
    def max_wave_bytes(self) -> int:
        return max((w.nbytes for w in self.waves), default=0)


def _align(n: int, to: int = SHARD_ALIGN) -> int:
    return -(-n // to) * to


def _pieces(leaves: list[Any], wave_cap: int, skip: frozenset[int]) -> list[Piece]:
    out: list[Piece] = []
    for i, leaf in enumerate(leaves):
        if i in skip:
            continue
        itemsize = ITEMSIZE[leaf.code]
        shape = leaf.stored_shape
        nbytes = leaf.nbytes
        if nbytes <= wave_cap - SHARD_ALIGN:
            out.append(Piece(i, leaf.name, leaf.code, shape, None, nbytes))
            continue
        per_chunk = max(1, (wave_cap - SHARD_ALIGN) // itemsize)
        numel = nbytes // itemsize
        for k, start in enumerate(range(0, numel, per_chunk)):
            end = min(numel, start + per_chunk)
            out.append(Piece(i, f"{leaf.name}#{k}", leaf.code, (end - start,), (start, end), (end - start) * itemsize))
    return out


def _balance(pieces: list[Piece], n_shards: int) -> list[list[Piece]]:
    """Longest processing time first: biggest piece onto the least loaded bin."""
    bins: list[list[Piece]] = [[] for _ in range(n_shards)]
    heap = [(0, i) for i in range(n_shards)]
    for piece in sorted(pieces, key=lambda p: -p.nbytes):
        load, i = heapq.heappop(heap)
        bins[i].append(piece)
        heapq.heappush(heap, (load + piece.nbytes, i))
    return [b for b in bins if b]


def plan_layout(leaves: list[Any], *, budget_bytes: int, workers: int,
                frozen: frozenset[int] = frozenset(), skip: frozenset[int] = frozenset(),
                prefix: str = "") -> Layout:
    """Assign every leaf (``.name``, ``.code``, ``.stored_shape``, ``.nbytes``) to waves and shards.

    Leaves in ``frozen`` never share a shard with other leaves; leaves in ``skip`` are not
    written (another rank writes them); shard file names start with ``prefix`` (a rank's).
    """
    total = sum(leaf.nbytes for i, leaf in enumerate(leaves) if i not in skip) + SHARD_ALIGN * max(1, workers)
    wave_cap = total if total <= budget_bytes else max(MIN_WAVE_BYTES, budget_bytes // 2 // SHARD_ALIGN * SHARD_ALIGN)
    pieces = _pieces(leaves, wave_cap, skip)
    if not pieces:
        return Layout(waves=[], nbytes=0)

    groups: list[list[Piece]] = [[]]
    used = 0
    for piece in pieces:
        if total > budget_bytes and groups[-1] and used + piece.nbytes + SHARD_ALIGN * (workers + 1) > wave_cap:
            groups.append([])
            used = 0
        groups[-1].append(piece)
        used += piece.nbytes

    layout = Layout(waves=[], nbytes=0)
    shard_index = 0
    for group in groups:
        wave = WavePlan(shards=[])
        offset = 0
        still = [p for p in group if p.leaf in frozen]
        moving = [p for p in group if p.leaf not in frozen]
        bins = [(b, True) for b in _balance(still, max(1, min(workers, len(still))))] if still else []
        bins += [(b, False) for b in _balance(moving, max(1, min(workers, len(moving))))] if moving else []
        for bin_pieces, is_frozen in bins:
            shard = ShardPlan(f"{prefix}shard-{shard_index:05d}.safetensors", [], offset=offset, frozen=is_frozen)
            shard_index += 1
            pos = 0
            for piece in sorted(bin_pieces, key=lambda p: -p.itemsize):
                piece.offset = offset + pos
                pos += piece.nbytes
                shard.pieces.append(piece)
            shard.nbytes = pos
            shard.header = build_header(
                [HeaderEntry(p.key, p.code, p.shape, p.offset - offset, p.offset - offset + p.nbytes) for p in shard.pieces],
                {"format": "pt", "producer": "mpckpt"}, align=SHARD_ALIGN,
            )
            for p in shard.pieces:
                start, end = p.chunk if p.chunk else (0, -1)
                layout.parts.setdefault(p.leaf, []).append((shard.filename, p.key, start, end))
            wave.shards.append(shard)
            offset = _align(offset + pos)
        wave.nbytes = max(offset, SHARD_ALIGN)
        layout.waves.append(wave)
        layout.nbytes += wave.nbytes
    for parts in layout.parts.values():
        parts.sort(key=lambda part: part[2])
    return layout


class LayoutCache:
    """The layouts of the last few state shapes a checkpointer saved (most states have one)."""

    SIZE = 8

    def __init__(self, *, budget_bytes: int, workers: int) -> None:
        self.budget_bytes, self.workers = budget_bytes, workers
        self._layouts: dict[Any, Layout] = {}

    def layout_for(self, flat: Any, *, skip: frozenset[int] = frozenset(), prefix: str = "") -> Layout:
        """The layout of ``flat`` (a ``FlatState``), planned on first sight of its shape
        (``skip``, ``prefix``: a rank's, the same for every save of one shape)."""
        key = flat.key
        layout = self._layouts.get(key)
        if layout is None:
            layout = plan_layout(flat.leaves, budget_bytes=self.budget_bytes, workers=self.workers,
                                 frozen=flat.frozen, skip=skip, prefix=prefix)
            if len(self._layouts) >= self.SIZE:
                self._layouts.pop(next(iter(self._layouts)))
            self._layouts[key] = layout
        return layout
