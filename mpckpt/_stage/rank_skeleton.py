"""Writing the skeleton each rank puts into a multi-rank checkpoint (``r<rank>-skeleton.json``).

It is the single-process skeleton (tree, tensor table, leaves; see ``_codec.snapshot``) of
what this rank saved, plus, per leaf, its ``kind``:

* ``local`` (under a ``PerRank``): this rank's own; ``parts`` says where its bytes are;
* ``replicated``: the same on every rank; ``writer`` is the rank that stored it, and only
  that rank's skeleton has its ``parts``;
* ``sharded`` (a DTensor): ``shape`` is the local shard's, ``global_shape`` and ``offset``
  place it in the global tensor; ``parts`` only where this rank stored the shard (of ranks
  holding the same shard, one does).

``blocks`` holds the xxh3-64 of every ``block_size`` bytes of each shard file this rank
wrote, so that a reader of a byte range checks it without reading the whole file; the
skeleton itself is covered by the manifest's checksum.

This module writes it (``RankSkeletonText``: from parts made once, as ``_stage.skeleton_text``
does for one process); ``_read.skeleton`` is the one parser (versions and limits:
``format.skeleton``).
"""

from __future__ import annotations

import threading
from typing import Any

from mpckpt._dtypes import dtype_name
from mpckpt.format.names import rank_prefix
from mpckpt.format.skeleton import RANK_SKELETON_VERSION


def rank_leaves_doc(flat: Any, layout: Any, plan: Any) -> list[dict[str, Any]]:
    """The ``leaves`` of a rank's skeleton (``flat``: its FlatState, ``layout`` what it wrote,
    ``plan`` who writes the replicated leaves)."""
    dist = flat.dist
    leaves = []
    for i, leaf in enumerate(flat.leaves):
        kind = dist.kinds[i]
        doc: dict[str, Any] = {"name": leaf.name, "dtype": dtype_name(leaf.dtype), "shape": list(leaf.shape),
                               "raw": leaf.raw, "kind": kind}
        parts = layout.parts.get(i)
        if parts is not None:
            doc["parts"] = [list(p) for p in parts]
        if kind == "sharded":
            shard = dist.shards[i]
            doc["global_shape"] = list(shard.global_shape)
            doc["offset"] = list(shard.offset)
        elif kind == "replicated":
            doc["writer"] = plan.writer[i]
        leaves.append(doc)
    return leaves


def blocks_doc(blocks: dict[str, list[str]], rank: int) -> dict[str, list[str]]:
    """Each shard file's block checksums, by its name without the rank's prefix."""
    prefix = rank_prefix(rank)
    return {name[len(prefix):] if name.startswith(prefix) else name: digests for name, digests in sorted(blocks.items())}


class RankSkeletonText:
    """This rank's skeleton bytes, save after save: the table's and the leaves' text made once per
    state shape, layout and plan (the flatten memo, the layout cache and the planner hand out the
    same objects while nothing changed), the tree joined from the nodes ``recall`` took over.
    Called from the training thread (a kept snapshot) and the committer.

    INVARIANT: the bytes are ``json.dumps(doc, separators=(",", ":"), allow_nan=False)`` of
    ``{"version", "rank", "world_size", "block_size", "tree", "table", "leaves", "blocks"}``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._parts: tuple[Any, ...] | None = None  # (table, leaves, layout, dist, plan, table text, leaves text)

    def __call__(self, flat: Any, layout: Any, plan: Any, blocks: dict[str, list[str]], *, rank: int,
                 world_size: int) -> bytes:
        from mpckpt._dist.plan import BLOCK_BYTES
        from mpckpt._stage.skeleton_text import dumps, tree_text

        key = (flat.table, flat.leaves, layout, flat.dist, plan)
        with self._lock:
            parts = self._parts
        if parts is None or any(a is not b for a, b in zip(parts[:5], key, strict=True)):
            parts = (*key, dumps(flat.table), dumps(rank_leaves_doc(flat, layout, plan)))
            with self._lock:
                self._parts = parts
        return (f'{{"version":{RANK_SKELETON_VERSION},"rank":{dumps(rank)},"world_size":{dumps(world_size)},'
                f'"block_size":{BLOCK_BYTES},"tree":{tree_text(flat.tree)},"table":{parts[5]},"leaves":{parts[6]},'
                f'"blocks":{dumps(blocks_doc(blocks, rank))}}}').encode()
