"""The JSON skeleton of a single-process save (``skeleton.json``), made from parts that repeat.

A skeleton is the tree of the state, its tensor table and its leaves (name, dtype, shape and
where the bytes are). A repeated save of the same state shape reuses the table and the leaves
(the flatten memo hands out the same objects; the layout is the cached one), and the tree of the
parts ``recall`` took over is made of the same nodes: their text is made once and joined, so a
save of thousands of tensors no longer serializes a megabyte of JSON on the training thread (the
snapshot kept in memory carries its skeleton; the committer writes the same bytes to storage).

INVARIANT: the bytes are those of ``json.dumps(doc, separators=(",", ":"), allow_nan=False)`` of
``{"version", "tree", "table", "leaves"}``: the parts are that text, and joining them changes nothing.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from mpckpt._codec.recall import FrozenNode
from mpckpt._codec.snapshot import FlatState
from mpckpt._codec.values import TAG
from mpckpt._dtypes import dtype_name
from mpckpt._stage.layout import Layout
from mpckpt.format.skeleton import SKELETON_VERSION

_SMALL = 64  # a node of more entries than this is dumped whole rather than walked in Python


def dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


def tree_text(node: Any) -> str:
    """The JSON of a skeleton tree, taking each ``FrozenNode``'s text as made once."""
    if type(node) is FrozenNode:
        return node.text()
    if type(node) is dict and len(node) <= 4 and node.get(TAG) in ("dict", "tuple") and len(node["v"]) <= _SMALL:
        parts = [f"{dumps(k)}:{tree_text(v) if k == 'v' else dumps(v)}" for k, v in node.items()]
        return "{" + ",".join(parts) + "}"
    if type(node) is list and len(node) <= _SMALL:
        return "[" + ",".join(map(tree_text, node)) + "]"
    return dumps(node)


class SkeletonText:
    """The skeleton bytes of one checkpointer's saves; the table's and the leaves' text made once
    per state shape. Called from the training thread (a kept snapshot) and the committer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._table: tuple[Any, str] | None = None       # (table object, its text)
        self._leaves: tuple[Any, Any, str] | None = None  # (leaves object, layout, their text)
        self._last: tuple[str, bytes] | None = None       # (tree text, the bytes made with it)

    def __call__(self, flat: FlatState, layout: Layout) -> bytes:
        with self._lock:
            table, leaves = self._table, self._leaves
        if table is None or table[0] is not flat.table:
            table = (flat.table, dumps(flat.table))
        if leaves is None or leaves[0] is not flat.leaves or leaves[1] is not layout:
            leaves = (flat.leaves, layout, dumps(leaves_doc(flat, layout)))
        tree = tree_text(flat.tree)
        with self._lock:
            last = self._last
            same = last is not None and self._table is table and self._leaves is leaves and last[0] == tree
            if same:
                assert last is not None
                return last[1]  # the very bytes of the last save: the kept record reuses their base64
            data = f'{{"version":{SKELETON_VERSION},"tree":{tree},"table":{table[1]},"leaves":{leaves[2]}}}'.encode()
            self._table, self._leaves, self._last = table, leaves, (tree, data)
            return data


def leaves_doc(flat: FlatState, layout: Layout) -> list[dict[str, Any]]:
    return [{"name": leaf.name, "dtype": dtype_name(leaf.dtype), "shape": list(leaf.shape), "raw": leaf.raw,
             "parts": [list(p) for p in layout.parts.get(i, [])]} for i, leaf in enumerate(flat.leaves)]
