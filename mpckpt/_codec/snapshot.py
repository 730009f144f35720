"""Flatten a training state into a JSON skeleton plus a table of tensors, and back.

What a state may hold: dicts (keys: str, int, float, bool, None), lists, tuples, tensors,
None, bool, int, float, str, bytes, torch.dtype / torch.Size / torch.device, the values
``values`` stores (numpy arrays and scalars, namedtuples, dataclasses, Enum members, sets,
OrderedDicts, pathlib paths, datetime values), and objects with ``state_dict()`` (modules,
optimizers, schedulers), which are replaced by what that returns. Anything else is refused
with a ``StateError`` naming the key, unless the caller opted in to pickle (``allow_pickle=True``).

In a multi-rank save (``distributed=True``) a ``DTensor`` (FSDP2, tensor parallel) is stored
as its local shard (``DistInfo`` says where the shard sits in the global tensor), tensors
under a ``PerRank`` are this rank's own, and every other tensor is replicated (``_dist.plan``
decides which rank writes it).

Tensors that share storage stay shared: identical views are stored once and come back as
one tensor; different views of one storage are stored as one byte range of that storage
(``base``) that every view is rebuilt from with ``as_strided``. Everything here runs before
a byte is written, so bad input never leaves anything behind.

Skeleton node encoding (JSON): lists are JSON arrays; str/int/bool/None and finite floats
are themselves; every other node is an object ``{"__mpckpt__": tag, ...}`` with tag one of
``dict`` (parallel ``k``/``v`` arrays, so int keys stay ints), ``tuple``, ``tensor`` (``id``
into the tensor table), ``float`` (nan/inf), ``bytes``, ``dtype``, ``size``, ``device``,
``pickle``, ``per_rank`` (a ``PerRank`` value: ``id``, its number in walk order, and ``v``),
and those of ``values``: ``ndarray``, ``npscalar``, ``namedtuple``,
``dataclass``, ``enum``, ``set``, ``frozenset``, ``odict``, ``path``, ``datetime``,
``date``, ``time``, ``timedelta``.
"""

from __future__ import annotations

import base64
import collections
import math
import pickle
from dataclasses import dataclass
from typing import Any

import torch

from mpckpt import _dtypes
from mpckpt._codec import values as _values
from mpckpt._codec.dtensor import PlacedShard, ShardInfo, is_dtensor, shard_info
from mpckpt._codec.recall import _DIRECT, _RAW, _VIA_REAL, FlattenMemo, Recall, _byte_range
from mpckpt._codec.values import TAG, path_of
from mpckpt.errors import StateError
from mpckpt.per_rank import PerRank

_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_SCALARS = frozenset({int, str, bool, type(None)})  # a list of only these is its own node
_KEY_TYPES = (str, int, float, bool, type(None))
_SHOWN_REFUSED = 3  # refused keys named in the error, of how many there are


def _article(name: str) -> str:
    """``name`` with its indefinite article: "an argparse.Namespace", "a collections.deque"."""
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


@dataclass(slots=True, frozen=True)
class TensorLeaf:
    """One tensor to store: how it is written, and how to rebuild the original."""

    name: str                     # safetensors key (derived from the first key path)
    code: str                     # safetensors dtype code as written
    dtype: torch.dtype            # original dtype
    shape: tuple[int, ...]        # original shape
    stored_shape: tuple[int, ...]  # shape as written (a real view of complex; bytes of a base)
    nbytes: int
    raw: bool = False             # a byte range of a storage that several views share


@dataclass(frozen=True)
class DistInfo:
    """What a multi-rank save needs to know about each leaf: ``kinds[i]`` is ``local`` (under a
    ``PerRank``), ``replicated`` or ``sharded`` (a DTensor; ``shards[i]``)."""

    kinds: tuple[str, ...]
    shards: dict[int, ShardInfo]
    placed: bool = False  # sharded leaves are ``PlacedShard``s, none replicated: the caller decided who writes


@dataclass
class FlatState:
    tree: Any
    leaves: list[TensorLeaf]
    # what gets copied for each leaf: a view of the state's memory, never a copy
    sources: list[torch.Tensor]
    # table rows in skeleton order; a row is either {"leaf": i} or {"view_of": i, ...}
    table: list[dict[str, Any]]
    # leaves that are parameters with requires_grad=False (frozen weights): they get shards
    # of their own, which later saves reference instead of rewriting while they are unchanged
    frozen: frozenset[int] = frozenset()
    on_cuda: bool = False  # any leaf lives on a CUDA device
    nbytes: int = 0
    # what a layout depends on (names, codes, shapes, frozen leaves): equal keys, equal layouts
    key: tuple[Any, ...] = ()
    dist: DistInfo | None = None  # a multi-rank save's view of the leaves (``distributed=True``)

    def versions(self, leaves: Any) -> tuple[tuple[int, int], ...]:
        """(address, in-place version counter) of each leaf: equal means unchanged."""
        return tuple((self.sources[i].data_ptr(), self.sources[i]._version) for i in leaves)


class RowsByObject:
    """``id(tensor object) -> row`` for the tensors a walk has seen. What ``Recall`` takes over is
    noted as blocks (their ids, the first row) and indexed only when something asks: a state whose
    tensors all sit in one dict (taken whole by ``Recall.tensors``) never builds the index."""

    __slots__ = ("_index", "_blocks")

    def __init__(self) -> None:
        self._index: dict[int, int] = {}
        self._blocks: list[tuple[list[int], int]] = []

    def _indexed(self) -> dict[int, int]:
        for ids, first in self._blocks:
            self._index.update(zip(ids, range(first, first + len(ids)), strict=True))
        self._blocks.clear()
        return self._index

    def get(self, key: int) -> int | None:
        return (self._indexed() if self._blocks else self._index).get(key)

    def __setitem__(self, key: int, row: int) -> None:
        (self._indexed() if self._blocks else self._index)[key] = row

    def note(self, ids: list[int], first_row: int) -> None:
        """Rows ``first_row`` on are the objects ``ids`` (distinct, none seen before: ``any_of``)."""
        self._blocks.append((ids, first_row))

    def any_of(self, ids: list[int]) -> bool:
        """Whether any of ``ids`` was seen in this walk."""
        if not self._index and not self._blocks:
            return False
        return any(map(self._indexed().__contains__, ids))


class _Flattener:
    """The walk: the skeleton tree, and every distinct tensor object (a *row*) in visit order."""

    def __init__(self, allow_pickle: bool, distributed: bool = False, recall: Recall | None = None) -> None:
        self.allow_pickle = allow_pickle
        self.distributed = distributed
        self.recall = None if distributed else recall  # the last walk's nodes a repeated save takes over
        self.per_rank_depth = 0
        self.per_rank_count = 0
        self.local_rows: set[int] = set()  # rows first seen under a PerRank
        self.dtensors: dict[int, Any] = {}  # row -> the DTensor whose local shard the row is
        self.dmeta: list[tuple[Any, ...]] = []  # what the memo compares of each DTensor
        self.rows: list[torch.Tensor] = []
        self.paths: list[str] = []  # key path of each row's first appearance
        self.active: set[int] = set()
        self.frozen_ptrs: set[int] = set()
        self.rows_by_object = RowsByObject()
        self.made: dict[int, Any] = {}  # id(value) -> what values.encode made of it (held for the save)
        self.refused: dict[str, tuple[str, str]] = {}  # path -> (what it holds, how to convert it)

    def visit(self, value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            return self.tensor(value, path)
        if type(value) is PerRank:
            return self.per_rank(value, path)
        if type(value) is PlacedShard:
            return self.placed(value, path)
        if type(value) is collections.OrderedDict:  # a state dict: ``values``' odict node, made here
            return self.container(value, path, lambda v, p: self.mapping(v, p, "odict"))
        if type(value) not in _values.PLAIN:  # first: IntEnum, numpy.float64, OrderedDict keep their type
            node = _values.encode(self, value, path)
            if node is not NotImplemented:
                return node
        if value is None or isinstance(value, (bool, int, str)):
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else {TAG: "float", "v": repr(value)}
        if isinstance(value, (bytes, bytearray)):
            return {TAG: "bytes", "v": base64.b64encode(bytes(value)).decode()}
        if isinstance(value, torch.dtype):
            return {TAG: "dtype", "v": _dtypes.dtype_name(value)}
        if isinstance(value, torch.Size):
            return {TAG: "size", "v": list(value)}
        if isinstance(value, torch.device):
            return {TAG: "device", "v": str(value)}
        if isinstance(value, dict):
            return self.container(value, path, self.mapping)
        if isinstance(value, list):
            if type(value) is list and set(map(type, value)) <= _SCALARS:  # a param group's "params"
                return list(value)
            return self.container(value, path, lambda v, p: [self.visit(x, path_of(p, i)) for i, x in enumerate(v)])
        if type(value) is tuple:
            return self.container(value, path, lambda v, p: {TAG: "tuple", "v": [self.visit(x, path_of(p, i)) for i, x in enumerate(v)]})
        if isinstance(value, torch.nn.Module):
            return self.module(value, path)
        if isinstance(value, torch.optim.Optimizer) and self.recall is not None:
            return self.container(value, path, lambda v, p: self.visit(self.recall.optimizers.state_dict(v), p))
        state_dict = getattr(value, "state_dict", None)
        if callable(state_dict) and not isinstance(value, type):
            return self.container(value, path, lambda v, p: self.visit(v.state_dict(), p))
        return self.fallback(value, path)

    def container(self, value: Any, path: str, fn: Any) -> Any:
        if id(value) in self.active:
            raise StateError(f"state key {path or '<root>'!r} contains itself (a reference cycle)", key=path)
        self.active.add(id(value))
        try:
            return fn(value, path)
        finally:
            self.active.discard(id(value))

    def module(self, value: torch.nn.Module, path: str) -> Any:
        node = None if self.recall is None else self.recall.module(self, value, path)
        if node is not None:
            return node
        row = len(self.rows)
        self.frozen_ptrs.update(p.data_ptr() for p in value.parameters() if not p.requires_grad)
        node = self.container(value, path, lambda v, p: self.visit(v.state_dict(), p))
        return node if self.recall is None else self.recall.learn_module(self, value, path, row, node)

    def mapping(self, value: dict, path: str, tag: str = "dict") -> dict[str, Any]:
        taken = None if self.recall is None else self.recall.tensors(self, value, path, tag)
        if taken is not None:
            return taken
        row = len(self.rows)
        keys, vals = [], []
        for k, v in value.items():
            if not isinstance(k, _KEY_TYPES) or (isinstance(k, float) and not math.isfinite(k)):
                raise StateError(
                    f"state key {path_of(path, repr(k))!r}: dict keys must be str, int, finite float, bool or None, "
                    f"not {type(k).__name__}; convert the key to a string",
                    key=path_of(path, repr(k)),
                )
            keys.append(k)
            vals.append(self.visit(v, path_of(path, k)))
        node: dict[str, Any] = {TAG: tag, "k": keys, "v": vals}
        if self.recall is None or self.refused:
            return node
        return self.recall.learn_tensors(self, value, path, tag, row, node)

    def fallback(self, value: Any, path: str) -> Any:
        if not self.allow_pickle:
            cls = type(value)
            name = f"{cls.__module__}.{cls.__qualname__}" if cls.__module__ != "builtins" else cls.__qualname__
            hint = (f"store vars({path.rsplit('.', 1)[-1] or 'args'}), a dict of its values"
                    if name == "argparse.Namespace"
                    else f"convert it to tensors or plain values: {_values.CONVERT}, .state_dict()")
            self.refuse(path, _article(name), hint)
            return None
        where = path or "<root>"
        try:
            blob = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            raise StateError(f"state key {where!r}: cannot pickle {type(value).__name__} ({e})", key=path) from e
        return {TAG: "pickle", "v": base64.b64encode(blob).decode()}

    def refuse(self, path: str, what: str, hint: str) -> None:
        """Note a value that cannot be stored without pickle; ``refusal`` names them all at the end."""
        self.refused.setdefault(path, (what, hint))  # a value refused by ``values`` is not noted again

    def refusal(self) -> StateError | None:
        """One error naming every refused key (the first few, and how many), or None."""
        if not self.refused:
            return None
        items = list(self.refused.items())
        shown = [f"state key {p or '<root>'!r} holds {what}: {hint}" for p, (what, hint) in items[:_SHOWN_REFUSED]]
        more = f"; and {len(items) - _SHOWN_REFUSED} more" if len(items) > _SHOWN_REFUSED else ""
        head = ("a value" if len(items) == 1 else f"{len(items)} values") + " that mpckpt cannot store without pickle"
        them = "it" if len(items) == 1 else "them"
        return StateError(f"the state holds {head}: {'; '.join(shown)}{more}. Convert {them}, or pass "
                          "allow_pickle=True (loading will then run pickle, which runs code from storage)",
                          key=items[0][0])

    def tensor(self, t: torch.Tensor, path: str) -> dict[str, Any]:
        # Hot path (one call per tensor per save): only note the tensor; checks and storage
        # grouping happen once per state shape (``FlattenMemo``), not once per save.
        row = self.rows_by_object.get(id(t))
        if row is None:  # a tensor object seen before is one table row, one object on load
            row = len(self.rows)
            self.rows_by_object[id(t)] = row  # ids are stable: ``rows`` holds every tensor meanwhile
            if type(t) not in _PLAIN_TENSORS and self.distributed and is_dtensor(t):
                dt: Any = t
                self.dtensors[row] = dt
                self.dmeta.append((row, dt.shape, dt.placements, id(dt.device_mesh)))
                t = dt._local_tensor
            self.rows.append(t)
            self.paths.append(path)
            if self.per_rank_depth:
                self.local_rows.add(row)
        return {TAG: "tensor", "id": row}

    def placed(self, shard: PlacedShard, path: str) -> dict[str, Any]:
        """A shard its caller placed (``PlacedShard``): stored as a DTensor's local shard is."""
        where = path or "<root>"
        if not self.distributed:
            raise StateError(f"state key {where!r} is a placed shard, which only a multi-rank save stores", key=path)
        row = len(self.rows)
        node = self.tensor(shard.local, path)
        if node["id"] != row:
            raise StateError(f"state key {where!r}: the tensor of a placed shard appears elsewhere in the state too",
                             key=path)
        self.dtensors[row] = shard
        self.dmeta.append((row, shard.info.global_shape, shard.info.offset, shard.info.writes))
        return node

    def per_rank(self, value: PerRank, path: str) -> dict[str, Any]:
        number = self.per_rank_count
        self.per_rank_count += 1
        self.per_rank_depth += 1
        try:
            return {TAG: "per_rank", "id": number, "v": self.visit(value.value, path)}
        finally:
            self.per_rank_depth -= 1


class _Tabulator:
    """The tensor table and the leaves of one walk's rows: checks, shared storage, names."""

    def __init__(self) -> None:
        self.leaves: list[TensorLeaf] = []
        self.sources: list[torch.Tensor] = []
        self.recipes: list[tuple[int, int, int, int]] = []  # per leaf: (row, how, start, length)
        self.table: list[dict[str, Any]] = []
        self.names: set[str] = set()
        # storage key -> list of (table row index, tensor, path)
        self.by_storage: dict[tuple[int, int], list[tuple[int, torch.Tensor, str]]] = {}

    def tabulate(self, rows: list[torch.Tensor], paths: list[str], alone: Any = ()) -> None:
        """``alone``: rows that never share a leaf with another row (DTensor shards)."""
        self.table = [{} for _ in rows]
        for row, (t, path) in enumerate(zip(rows, paths, strict=True)):
            if (type(t) not in _PLAIN_TENSORS or t.layout is not torch.strided or t.is_nested or t.is_meta
                    or not _dtypes.is_supported(t.dtype)):
                self.reject(t, path)
            if t.numel() == 0 or row in alone:
                self.table[row] = {"leaf": self.add_leaf(row, t, path)}
            else:
                base = t.data_ptr() - t.storage_offset() * t.element_size()
                self.by_storage.setdefault((t.get_device(), int(base)), []).append((row, t, path))
        self.resolve_shared()

    def reject(self, t: torch.Tensor, path: str) -> None:
        where = path or "<root>"
        if t.is_quantized:
            raise StateError(f"state key {where!r} is a quantized tensor; save .int_repr() and its scales", key=path)
        if t.layout != torch.strided:
            raise StateError(f"state key {where!r} is a {t.layout} tensor; call .to_dense() before saving", key=path)
        if t.is_nested:
            raise StateError(f"state key {where!r} is a nested tensor; unbind it into a list of tensors", key=path)
        if t.is_meta:
            raise StateError(f"state key {where!r} is on the meta device and has no data to save", key=path)
        if type(t) not in _PLAIN_TENSORS:
            raise StateError(
                f"state key {where!r} is a tensor subclass {type(t).__name__}; save a plain tensor (e.g. .full_tensor())",
                key=path,
            )
        raise StateError(f"state key {where!r} has dtype {t.dtype}, which mpckpt cannot store", key=path)

    def add_leaf(self, row: int, t: torch.Tensor, path: str, *, raw: bool = False) -> int:
        name = path or "tensor"
        while name in self.names:
            name += "_"
        self.names.add(name)
        source, code = (t, "U8") if raw else _dtypes.storage_view(t)
        nbytes = source.numel() * source.element_size()
        how = _RAW if raw else (_DIRECT if source is t else _VIA_REAL)
        self.recipes.append((row, how, int(source.storage_offset()) if raw else 0, nbytes))
        self.leaves.append(TensorLeaf(name, code, t.dtype, tuple(t.shape), tuple(source.shape), nbytes, raw))
        self.sources.append(source)
        return len(self.leaves) - 1

    def resolve_shared(self) -> None:
        """Turn the storage groups into leaves: one per view, or one byte base per storage."""
        for group in self.by_storage.values():
            first_row, first, path = group[0]
            if len(group) == 1:
                self.table[first_row] = {"leaf": self.add_leaf(first_row, first, path)}
                continue
            sig = _view_signature(first)
            if all(_view_signature(t) == sig for _, t, _ in group):
                leaf = self.add_leaf(first_row, first, path)
                for row, _, _ in group:
                    self.table[row] = {"leaf": leaf}
                continue
            lo = min(t.storage_offset() * t.element_size() for _, t, _ in group)
            hi = max(_end_byte(t) for _, t, _ in group)
            leaf = self.add_leaf(first_row, _byte_range(first, int(lo), int(hi - lo)), f"{path}@storage", raw=True)
            for row, t, _ in group:
                self.table[row] = {
                    "view_of": leaf,
                    "byte_offset": t.storage_offset() * t.element_size() - lo,
                    "dtype": _dtypes.dtype_name(t.dtype),
                    "shape": list(t.shape),
                    "stride": list(t.stride()),
                }


def _view_signature(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.dtype, tuple(t.shape), t.stride(), t.storage_offset())


def _end_byte(t: torch.Tensor) -> int:
    if t.numel() == 0:
        return int(t.storage_offset() * t.element_size())
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True))
    return int((t.storage_offset() + last + 1) * t.element_size())


def flatten(state: Any, *, allow_pickle: bool = False, memo: FlattenMemo | None = None,
            distributed: bool = False) -> FlatState:
    """Split ``state`` into a skeleton tree and the tensors to store; raises ``StateError``.

    With a ``memo`` (one per checkpointer), a state that has the same tensors as the last one
    flattened skips the checks and grouping it already passed. ``distributed``: a multi-rank
    save (DTensors become their local shards; ``FlatState.dist``).
    """
    if state is None:
        raise StateError("state is None; pass a dict such as {'model': model, 'optim': optimizer}")
    recall = None if memo is None else memo.recall
    f = _Flattener(allow_pickle, distributed, recall)
    if recall is not None:
        recall.begin()
    tree = f.visit(state, "")
    refused = f.refusal()
    if refused is not None:
        raise refused
    if memo is not None:
        memo.recall.done()
        flat = memo.reuse(f, tree)
        if flat is not None:
            return flat
    tab = _Tabulator()
    tab.tabulate(f.rows, f.paths, alone=f.dtensors)
    leaves, sources = tab.leaves, tab.sources
    dist = _dist_info(f, tab) if distributed else None
    frozen = frozenset(i for i, leaf in enumerate(leaves)
                       if f.frozen_ptrs and not leaf.raw and leaf.nbytes and sources[i].data_ptr() in f.frozen_ptrs
                       and dist is None)  # (a multi-rank save rewrites every shard)
    on_cuda = any(source.is_cuda for source in sources) if torch.cuda.is_available() else False
    key: tuple[Any, ...] = (tuple([(leaf.name, leaf.code, leaf.stored_shape) for leaf in leaves]), frozen)
    if dist is not None:
        key += (dist.kinds, tuple(sorted((i, s.global_shape, s.offset, s.writes) for i, s in dist.shards.items())))
    flat = FlatState(tree, leaves, sources, tab.table, frozen, on_cuda, sum(leaf.nbytes for leaf in leaves), key,
                     dist)
    if memo is not None:
        memo.remember(f, tab, flat)
    return flat


def _dist_info(f: _Flattener, tab: _Tabulator) -> DistInfo:
    """Each leaf's kind, and where each DTensor leaf's shard sits in its global tensor."""
    kinds: list[str] = []
    shards: dict[int, ShardInfo] = {}
    for i, (row, _, _, _) in enumerate(tab.recipes):
        dt = f.dtensors.get(row)
        if dt is None:
            kinds.append("local" if row in f.local_rows else "replicated")
            continue
        path = f.paths[row] or "<root>"
        if row in f.local_rows:
            raise StateError(f"state key {path!r} is a DTensor under a PerRank; a DTensor is already stored per "
                             "shard: take it out of the PerRank", key=f.paths[row])
        shards[i] = dt.info if type(dt) is PlacedShard else shard_info(dt, path)
        kinds.append("sharded")
    placed = any(type(dt) is PlacedShard for dt in f.dtensors.values()) and "replicated" not in kinds
    return DistInfo(tuple(kinds), shards, placed)
