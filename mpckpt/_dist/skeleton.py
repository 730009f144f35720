"""Writing the skeleton each rank puts into a multi-rank checkpoint (``r<rank>-skeleton.json``).

It is the single-process skeleton (tree, tensor table, leaves; see ``_stage.snapshot``) of
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

This module writes it; ``_read.skeleton`` is the one parser (versions and limits:
``format.skeleton``).
"""

from __future__ import annotations

import json
from typing import Any

from mpckpt._dtypes import dtype_name
from mpckpt.format.names import rank_prefix
from mpckpt.format.skeleton import RANK_SKELETON_VERSION


def rank_skeleton_bytes(flat: Any, layout: Any, plan: Any, blocks: dict[str, list[str]], *, rank: int,
                        world_size: int) -> bytes:
    """This rank's skeleton (``flat``: its FlatState, ``layout`` what it wrote, ``plan`` who
    writes the replicated leaves, ``blocks`` the block checksums its uploaders returned)."""
    from mpckpt._dist.plan import BLOCK_BYTES

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
    prefix = rank_prefix(rank)
    doc = {"version": RANK_SKELETON_VERSION, "rank": rank, "world_size": world_size, "block_size": BLOCK_BYTES,
           "tree": flat.tree, "table": flat.table, "leaves": leaves,
           "blocks": {name[len(prefix):] if name.startswith(prefix) else name: digests
                      for name, digests in sorted(blocks.items())}}
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
