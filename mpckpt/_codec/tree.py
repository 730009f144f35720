"""Rebuilding a state from its skeleton: the tensor table's rows, then the tree of values.

The skeleton (see ``_codec.snapshot`` for how a save writes it) is plain JSON: every node is
checked before it is used, nothing is evaluated, no class is imported that the process has
not imported itself (``values``), and pickled values are refused unless the caller opted in.
Everything a hostile or damaged skeleton can make this raise is a ``CorruptCheckpointError``
(or a ``StateError`` naming the key of a pickled value): the read side turns it into an
error naming the skeleton file.

Both reading paths use it: the one of a single process's checkpoint and the multi-rank one
(``per_rank`` says what a ``PerRank`` node becomes there).
"""

from __future__ import annotations

import base64
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mpckpt import _dtypes
from mpckpt._codec import values as _values
from mpckpt._codec.values import TAG, path_of
from mpckpt.errors import CorruptCheckpointError, StateError


def _index(value: Any, count: int, what: str) -> int:
    """``value`` as an index into ``count`` items (never a negative one that Python would accept)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < count:
        raise CorruptCheckpointError(f"{what} {str(value)[:40]!r} is not an index below {count}")
    return value


def _check_inside(shape: Any, stride: Any, start: int, available: int) -> None:
    """A view of ``shape``/``stride`` from element ``start`` stays inside ``available`` elements
    (checked here, not left to torch: meta tensors, which ``verify`` uses, do not check)."""
    if not (isinstance(shape, list) and isinstance(stride, list) and len(shape) == len(stride)) or not all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in [*shape, *stride, start]):
        raise ValueError("shape and stride must be lists of non-negative integers of one length")
    if all(n > 0 for n in shape) and start + sum((n - 1) * st for n, st in zip(shape, stride, strict=True)) >= available:
        raise ValueError(f"the view reaches past the {available} elements of its base")


def build_tensors(table: list[dict[str, Any]], leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """Rows of the tensor table as tensors, given the loaded leaves (original dtype/shape).

    The leaves may be meta tensors: ``mpckpt verify`` checks the table without reading data.
    """
    if not isinstance(table, list):
        raise CorruptCheckpointError("the tensor table is not a list")
    out = []
    for i, row in enumerate(table):
        if not isinstance(row, dict):
            raise CorruptCheckpointError(f"tensor table row {i} is not an object")
        if "leaf" in row:
            out.append(leaves[_index(row["leaf"], len(leaves), f"tensor table row {i}: leaf")])
            continue
        try:
            # every view of one base shares the base's memory (its own, aligned: see restore)
            base = leaves[_index(row["view_of"], len(leaves), f"tensor table row {i}: view_of")]
            dtype = _dtypes.dtype_from_name(row["dtype"])
            itemsize = torch.empty((), dtype=dtype).element_size()
            offset = row["byte_offset"]
            if offset % itemsize:
                raise ValueError("misaligned view")
            usable = base.numel() - base.numel() % itemsize
            typed = base[:usable].view(dtype)
            _check_inside(row["shape"], row["stride"], offset // itemsize, typed.numel())
            # as_strided takes an absolute storage offset (0 for a loaded base; kept general)
            out.append(torch.as_strided(typed, row["shape"], row["stride"], typed.storage_offset() + offset // itemsize))
        except (KeyError, ValueError, RuntimeError, IndexError, TypeError, OverflowError) as e:
            raise CorruptCheckpointError(f"tensor table row {i} describes an invalid view ({e})") from e
    return out


PerRankHook = Callable[[int, Any, str], Any]


def one_rank(number: int, value: Any, path: str) -> Any:
    """A ``PerRank`` node of a single-process checkpoint, as ``mpckpt.load`` gives it: the list
    of every rank's value (one)."""
    return [value]


def unflatten(node: Any, tensors: list[torch.Tensor], *, allow_pickle: bool = False, check_only: bool = False,
              classes: bool = True, per_rank: PerRankHook = one_rank) -> Any:
    """Rebuild the plain nested structure from a skeleton tree (never runs code unless opted in).

    With ``check_only`` every node is checked and pickled values are only decoded, never
    unpickled (``mpckpt verify``); no class is imported. With ``classes=False`` namedtuples,
    dataclasses and Enum members come back as plain values, without importing their classes.
    ``per_rank(number, value, path)`` gives what a ``PerRank`` node becomes (``one_rank``: a list).
    """
    try:
        return _Unflattener(tensors, allow_pickle, check_only, classes, per_rank).node(node, "")
    except RecursionError as e:
        raise CorruptCheckpointError("the skeleton tree is nested too deeply") from e


@dataclass
class _Unflattener:
    tensors: list[torch.Tensor]
    allow_pickle: bool
    check_only: bool
    classes: bool
    per_rank: PerRankHook

    def node(self, node: Any, path: str) -> Any:
        if isinstance(node, list):
            return [self.node(x, path_of(path, i)) for i, x in enumerate(node)]
        if not isinstance(node, dict):
            return node
        tag = node.get(TAG)
        try:
            if tag == "dict":
                return {k: self.node(v, path_of(path, k)) for k, v in zip(node["k"], node["v"], strict=True)}
            if tag == "tuple":
                return tuple(self.node(x, path_of(path, i)) for i, x in enumerate(node["v"]))
            if tag in _values.TAGS:
                return _values.decode(node, tag, path, _values.Reader(self.node, self.check_only, self.classes))
            if tag == "tensor":
                return self.tensors[_index(node["id"], len(self.tensors), "tensor id")]
            if tag == "per_rank":
                number = node["id"]
                if isinstance(number, bool) or not isinstance(number, int) or number < 0:
                    raise ValueError(f"per_rank id {str(number)[:40]!r} is not a non-negative integer")
                return self.per_rank(number, self.node(node["v"], path), path)
            if tag == "float":
                return float(node["v"])
            if tag == "bytes":
                return base64.b64decode(node["v"])
            if tag == "dtype":
                return _dtypes.dtype_from_name(node["v"])
            if tag == "size":
                return torch.Size(node["v"])
            if tag == "device":
                return torch.device(node["v"])
            if tag == "pickle":
                if self.check_only:
                    base64.b64decode(node["v"], validate=True)
                    return None
                if not self.allow_pickle:
                    raise StateError(
                        f"this checkpoint holds a pickled value (state key {path or '<root>'!r}); loading it runs "
                        "code from storage. Pass allow_pickle=True only if you trust where it came from", key=path
                    )
                return pickle.loads(base64.b64decode(node["v"]))
        except (StateError, CorruptCheckpointError):
            raise
        except (KeyError, IndexError, TypeError, ValueError, RuntimeError, OverflowError) as e:
            raise CorruptCheckpointError(f"skeleton node {str(tag)[:40]!r} is malformed ({str(e)[:200]})") from e
        raise CorruptCheckpointError(f"skeleton holds an unknown node {str(node)[:80]!r}")
