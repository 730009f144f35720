"""What a repeated save takes over from the flatten before it: the table, and the parts of the walk
whose shape did not change.

``FlattenMemo`` keeps what the last flatten concluded about its tensors (checks, storage groups,
names, layout key) while every row keeps its ``Signatures`` (``signatures``). A training loop hands ``save`` the same objects again and again. The flattener (``snapshot``)
asks a ``Recall`` at three kinds of node and uses its answer only when it is what a fresh walk
would make:

* a module whose every submodule keeps torch's own ``state_dict`` (no override, no state-dict
  hook, no extra state): its parameters and persistent buffers are read from the module tree
  instead of calling ``state_dict()`` (which detaches every tensor and builds a key string per
  tensor); every submodule's class and the names, order and None-ness of its parameters,
  buffers and children must be those of the last walk, checked module by module;
* a dict (or OrderedDict) whose values are all plain tensors (a state dict, a dict of tensors);
* a dict whose values are all dicts of plain tensors under string keys (an optimizer's ``state``).

An optimizer's state dict itself is made from the last save's numbering of its parameters
(``optim_state``) rather than by ``state_dict()``, when that is torch's own.

It gives the last walk's skeleton node (a ``FrozenNode``, whose JSON text is made once) and key
paths, and the live tensors as this walk's rows. The structure alone is checked here: what the
tensor table depends on (addresses, dtypes, shapes, strides) is checked by the flatten memo for
every walk (``same_rows``). INVARIANT: a node is taken only at the key path and the row number
it was made at, so the tensor ids inside it still name the right rows.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import operator
from dataclasses import dataclass
from typing import Any

import torch

from mpckpt import _dtypes
from mpckpt._codec.optim_state import OptimizerStates
from mpckpt._codec.signatures import PLAIN_TENSORS, Signatures

_is_none = functools.partial(operator.is_, None)
_SD, _SAVE = torch.nn.Module.state_dict, torch.nn.Module._save_to_state_dict
_EXTRA = torch.nn.Module.get_extra_state
_MAX_MODULES = 1 << 20  # a module tree that contains itself is no tree: the fresh walk says so


class FrozenNode(dict):  # type: ignore[type-arg]
    """A skeleton node reused between saves; ``text()`` is its JSON, made once."""

    __slots__ = ("_text",)

    def text(self) -> str:
        text: str | None = getattr(self, "_text", None)
        if text is None:
            text = self._text = json.dumps(self, separators=(",", ":"), allow_nan=False)
        return text


@dataclass(slots=True)
class _Entry:
    kind: str          # "tensors" (dict of tensors), "dicts" (dict of dicts of tensors), "module"
    tag: str           # the node's tag ("dict", "odict"; "module" for a module)
    row: int           # the row number of its first tensor
    keys: Any          # what the structure is checked against (per kind)
    key_types: Any     # the keys' types when not all str (1, 1.0 and True are equal keys)
    node: FrozenNode
    paths: list[str]
    count: int         # its tensors
    classes: frozenset[type] = frozenset()  # a module's classes, whose state_dict must stay torch's
    keys_inner: list[tuple[str, ...]] | None = None  # "dicts": each inner dict's keys


class Recall:
    """The nodes of the last walk of one checkpointer's states, by key path."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, str], _Entry] = {}
        self._next: dict[tuple[str, str], _Entry] = {}
        self.optimizers = OptimizerStates()  # their state dicts, numbered as the last save numbered them

    def begin(self) -> None:
        self._next = {}

    def done(self) -> None:
        """The walk completed: what it took or made is what the next one may take."""
        self._last, self._next = self._next, {}

    # -- taking ---------------------------------------------------------------------------------
    def tensors(self, f: Any, value: dict, path: str, tag: str) -> FrozenNode | None:
        """The node of ``value`` (a dict of tensors, or of dicts of tensors), as the last walk made it."""
        e = self._last.get(("d", path))
        if e is None or e.row != len(f.rows) or e.tag != tag or len(value) != len(e.keys):
            return None
        keys = list(value)
        if keys != e.keys or (e.key_types is not None and list(map(type, keys)) != e.key_types):
            return None
        if e.kind == "tensors":
            tensors = list(value.values())
        else:
            inner = list(value.values())
            if set(map(type, inner)) != {dict} or list(map(tuple, inner)) != e.keys_inner:
                return None
            tensors = [t for d in inner for t in d.values()]
        return self._take(f, ("d", path), e, tensors, register=True)

    def module(self, f: Any, module: torch.nn.Module, path: str) -> FrozenNode | None:
        """The node of ``module``'s state dict without calling ``state_dict()``, as the last walk made it."""
        e = self._last.get(("m", path))
        if e is None or e.row != len(f.rows) or not all(map(_default_state_dict, e.classes)):
            return None
        got = _gather(module, e.keys)
        if got is None:
            return None
        tensors, params = got
        node = self._take(f, ("m", path), e, tensors, register=False)
        if node is not None:  # as the walk notes of every module: its frozen parameters
            f.frozen_ptrs.update(p.data_ptr() for p in params if not p.requires_grad)
        return node

    def _take(self, f: Any, key: tuple[str, str], e: _Entry, tensors: list[Any], *, register: bool) -> FrozenNode | None:
        if len(tensors) != e.count or not set(map(type, tensors)) <= PLAIN_TENSORS:
            return None
        if register:  # a tensor object seen before in this walk is one row for both: the fresh walk's
            ids = list(map(id, tensors))
            seen = f.rows_by_object
            if len(set(ids)) != len(ids) or seen.any_of(ids):
                return None
            seen.note(ids, e.row)
        # (a module's tensors are not noted: state_dict() gives fresh objects no other value can be)
        f.rows.extend(tensors)
        f.paths.extend(e.paths)
        if f.per_rank_depth:
            f.local_rows.update(range(e.row, e.row + e.count))
        self._next[key] = e
        return e.node

    # -- learning -------------------------------------------------------------------------------
    def learn_tensors(self, f: Any, value: dict, path: str, tag: str, row: int, node: dict) -> dict:
        """After a fresh walk of the dict ``value`` made ``node``: remember it if it is of a kind
        ``tensors`` takes; the node to put in the tree."""
        values = list(value.values())
        kinds = set(map(type, values))
        count = len(f.rows) - row
        if not values or f.dtensors:
            return node
        keys = list(value)
        key_types = None if set(map(type, keys)) == {str} else list(map(type, keys))
        if kinds <= PLAIN_TENSORS:
            if count != len(values):  # a tensor seen before: not one new row per value
                return node
            e = _Entry("tensors", tag, row, keys, key_types, FrozenNode(node), f.paths[row:], count)
        elif kinds == {dict}:
            inner = [list(d) for d in values]
            if any(set(map(type, k)) != {str} for k in inner):
                return node
            tensors = [t for d in values for t in d.values()]
            if not set(map(type, tensors)) <= PLAIN_TENSORS or count != len(tensors):
                return node
            e = _Entry("dicts", tag, row, keys, key_types, FrozenNode(node), f.paths[row:], count,
                       keys_inner=[tuple(k) for k in inner])
        else:
            return node
        self._next[("d", path)] = e
        return e.node

    def learn_module(self, f: Any, module: torch.nn.Module, path: str, row: int, node: Any) -> Any:
        """After a fresh walk of ``module`` (its ``state_dict()``) made ``node``: remember it when the
        module tree alone says what ``state_dict()`` gives."""
        count = len(f.rows) - row
        if f.dtensors or not isinstance(node, dict) or node.get("v") is None:
            return node
        seen = _fingerprint(module)
        if seen is None:
            return node
        fingerprint, classes, keys = seen
        if keys != node.get("k") or count != len(keys):
            return node
        e = _Entry("module", "module", row, fingerprint, None, FrozenNode(node), f.paths[row:], count,
                   frozenset(classes))
        self._next[("m", path)] = e
        return e.node


def _default_state_dict(cls: type) -> bool:
    """Whether ``cls``'s state dict is torch's own: what ``_gather`` reads from the module tree."""
    return (getattr(cls, "state_dict", None) is _SD and getattr(cls, "_save_to_state_dict", None) is _SAVE
            and getattr(cls, "get_extra_state", _EXTRA) is _EXTRA)


def _instance_default(module: torch.nn.Module) -> bool:
    d = module.__dict__
    return not (d.get("_state_dict_hooks") or d.get("_state_dict_pre_hooks") or "state_dict" in d
                or "_save_to_state_dict" in d)


def _fingerprint(root: torch.nn.Module) -> tuple[list[tuple[Any, ...]], set[type], list[str]] | None:
    """Per module in ``state_dict()``'s order (the module, then its children, depth first): its class
    and the names of its parameters, buffers and children, with which are None or not persistent;
    and the keys ``state_dict()`` gives. None when a module's state dict is not torch's own."""
    fingerprint: list[tuple[Any, ...]] = []
    classes: set[type] = set()
    keys: list[str] = []
    stack: list[tuple[torch.nn.Module, str]] = [(root, "")]
    while stack:
        module, prefix = stack.pop()
        cls = type(module)
        if not (_default_state_dict(cls) and _instance_default(module)) or len(fingerprint) > _MAX_MODULES:
            return None
        ps, bs, cs = module._parameters, module._buffers, module._modules
        skip = frozenset(module._non_persistent_buffers_set)
        taken_buffers = tuple(k for k, v in bs.items() if v is not None and k not in skip)
        fingerprint.append((cls, tuple(ps), tuple(k for k, v in ps.items() if v is None), tuple(bs), taken_buffers,
                            tuple(k for k, v in bs.items() if v is None and k not in skip), skip, tuple(cs),
                            tuple(k for k, c in cs.items() if c is None)))
        classes.add(cls)
        keys += [prefix + k for k, v in ps.items() if v is not None]
        keys += [prefix + k for k in taken_buffers]
        stack.extend(reversed([(c, f"{prefix}{k}.") for k, c in cs.items() if c is not None]))
    return fingerprint, classes, keys


def _gather(root: torch.nn.Module, fingerprint: list[tuple[Any, ...]]) -> tuple[list[Any], list[Any]] | None:
    """The tensors ``root.state_dict()`` would give (the live ones, not detached), in its order, and
    the parameters among them; None when the module tree is not the one ``fingerprint`` describes."""
    tensors: list[Any] = []
    params: list[Any] = []
    stack = [root]
    at, end = 0, len(fingerprint)
    while stack:
        module = stack.pop()
        if at == end:
            return None
        cls, p_all, p_none, b_all, b_take, b_none, skip, c_all, c_none = fingerprint[at]
        at += 1
        if type(module) is not cls or not _instance_default(module):
            return None
        ps, bs, cs = module._parameters, module._buffers, module._modules
        if tuple(ps) != p_all or tuple(cs) != c_all:
            return None
        taken: list[Any]
        if p_none:
            if any(ps[k] is not None for k in p_none):
                return None
            taken = [v for v in ps.values() if v is not None]  # (the last walk's None ones are None still)
        else:
            taken = list(ps.values())  # a parameter set to None since: caught by the type check
        params += taken
        tensors += taken
        if b_all or bs:
            if tuple(bs) != b_all or module._non_persistent_buffers_set != skip:
                return None
            if any(bs[k] is not None for k in b_none):
                return None
            tensors += [bs[k] for k in b_take]
        if c_all:
            children: list[Any] = list(cs.values())
            if c_none:
                if any(cs[k] is not None for k in c_none):
                    return None
                children = [c for c in children if c is not None]
            elif any(map(_is_none, children)):
                return None
            stack.extend(reversed(children))
    return (tensors, params) if at == end else None


_DIRECT, _VIA_REAL, _RAW = 0, 1, 2  # how a leaf's source is made from its row's tensor


def _byte_range(t: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """Bytes ``start`` to ``start + length`` of ``t``'s storage as a uint8 tensor."""
    base = torch.empty(0, dtype=torch.uint8, device=t.device)
    base.set_(t.untyped_storage(), start, (length,), (1,))
    return base


@dataclass
class _Remembered:
    signatures: Signatures
    paths: list[str]
    frozen_ptrs: set[int]
    local_rows: set[int]
    dmeta: list[tuple[Any, ...]]
    flat: Any  # a FlatState, with its sources dropped: the memo keeps no tensor alive
    recipes: list[tuple[int, int, int, int]]
    direct_rows: list[int] | None  # when every leaf is its row's tensor as it is


class FlattenMemo:
    """What the last flatten of one checkpointer concluded about its tensors.

    A training loop saves the same tensors again and again: the same storages, dtypes,
    shapes and key paths, only new values. When a walk finds exactly that again, the checks,
    storage grouping, names and layout key are reused and only the sources are rebound to
    this walk's tensor objects (``state_dict()`` makes new ones each time), which keeps the
    per-tensor cost of a repeated save near that of the walk itself.
    """

    def __init__(self) -> None:
        self._last: _Remembered | None = None
        self.recall = Recall()  # what the walk itself takes over (``recall``)

    def reuse(self, f: Any, tree: Any) -> Any:
        """The flat state of this walk from the memo, or None when anything differs."""
        last = self._last
        if last is None or f.frozen_ptrs != last.frozen_ptrs or f.local_rows != last.local_rows:
            return None
        if f.dmeta != last.dmeta or f.paths != last.paths or not last.signatures.match(f.rows):
            return None
        rows = f.rows
        if last.direct_rows is not None:
            sources = list(rows) if last.direct_rows is _EVERY_ROW else [rows[r] for r in last.direct_rows]
        else:
            sources = [_rebind(rows[row], how, start, length) for row, how, start, length in last.recipes]
        return dataclasses.replace(last.flat, tree=tree, sources=sources)

    def remember(self, f: Any, tab: Any, flat: Any) -> None:
        signatures = Signatures.of(f.rows)
        if signatures is None:
            self._last = None
            return
        direct = all(how == _DIRECT for _, how, _, _ in tab.recipes)
        kept = dataclasses.replace(flat, tree=None, sources=[])
        self._last = _Remembered(signatures, f.paths, f.frozen_ptrs, set(f.local_rows), list(f.dmeta), kept,
                                 tab.recipes,
                                 _direct_rows(tab.recipes) if direct else None)


_EVERY_ROW: list[int] = []  # every row, in order, is a leaf as it is: the sources are the rows


def _direct_rows(recipes: list[tuple[int, int, int, int]]) -> list[int]:
    rows = [row for row, _, _, _ in recipes]
    return _EVERY_ROW if rows == list(range(len(rows))) else rows


def _rebind(t: torch.Tensor, how: int, start: int, length: int) -> torch.Tensor:
    if how == _DIRECT:
        return t
    if how == _VIA_REAL:
        return _dtypes.storage_view(t)[0]
    return _byte_range(t, start, length)
