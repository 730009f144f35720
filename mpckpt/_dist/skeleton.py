"""The skeleton each rank writes into a multi-rank checkpoint (``r<rank>-skeleton.json``).

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

``read_rank_skeletons`` reads every rank's skeleton, bounded and verified, and checks its
shape before anything trusts it.
"""

from __future__ import annotations

import concurrent.futures
import json
from dataclasses import dataclass
from typing import Any

from mpckpt._dtypes import dtype_name
from mpckpt.errors import CorruptCheckpointError
from mpckpt.format.manifest import Manifest
from mpckpt.format.names import rank_prefix, rank_skeleton_name
from mpckpt.format.skeleton import KINDS, MAX_SKELETON_BYTES, RANK_SKELETON_VERSION
from mpckpt.restore import read_verified
from mpckpt.storage import Backend


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


@dataclass
class RankSkeleton:
    rank: int
    tree: Any
    table: list[dict[str, Any]]
    leaves: list[dict[str, Any]]
    block_size: int
    blocks: dict[str, list[str]]  # file name in the checkpoint (with the rank prefix) -> digests


def read_rank_skeletons(backend: Backend, name: str, manifest: Manifest, *, threads: int = 8) -> list[RankSkeleton]:
    """Every rank's skeleton of multi-rank checkpoint ``name``, verified, in rank order."""
    world = manifest.world_size
    names = [rank_skeleton_name(r) for r in range(world)]
    for rel in names:
        entry = manifest.files.get(rel)
        if entry is None:
            raise CorruptCheckpointError(f"{name}: saved by {world} ranks, but the manifest lists no {rel}",
                                         path=f"{name}/{rel}")
        if entry.size > MAX_SKELETON_BYTES:
            raise CorruptCheckpointError(f"{name}/{rel}: the manifest says {entry.size} bytes, more than a skeleton "
                                         "may have; not read", path=f"{name}/{rel}")
    with concurrent.futures.ThreadPoolExecutor(min(threads, world), thread_name_prefix="mpckpt-skeleton") as pool:
        raws = list(pool.map(lambda rel: read_verified(backend, name, manifest, rel), names))
    return [_parse(name, rank, names[rank], raw, manifest) for rank, raw in enumerate(raws)]


def _parse(name: str, rank: int, rel: str, raw: bytes, manifest: Manifest) -> RankSkeleton:
    where = f"{name}/{rel}"
    try:
        doc = json.loads(raw)
        if doc["version"] != RANK_SKELETON_VERSION:
            raise ValueError(f"version {str(doc['version'])[:20]!r} is not one this mpckpt reads")
        if doc["rank"] != rank or doc["world_size"] != manifest.world_size:
            raise ValueError(f"it says rank {doc['rank']!r} of {doc['world_size']!r}")
        block_size = doc["block_size"]
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size {str(block_size)[:20]!r} is not a positive integer")
        leaves, table, blocks = doc["leaves"], doc["table"], doc["blocks"]
        if not isinstance(leaves, list) or not isinstance(table, list) or not isinstance(blocks, dict):
            raise ValueError("leaves, table and blocks have the wrong types")
        prefix = rank_prefix(rank)
        for spec in leaves:
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or spec.get("kind") not in KINDS:
                raise ValueError(f"leaf {str(spec)[:80]} is malformed")
            for part in spec.get("parts", []):
                if not (isinstance(part, list) and len(part) == 4 and isinstance(part[0], str)
                        and part[0].startswith(prefix) and isinstance(part[1], str)
                        and all(isinstance(x, int) and not isinstance(x, bool) for x in part[2:])):
                    raise ValueError(f"leaf {spec['name'][:80]!r} has a malformed part")
                if part[0] not in manifest.files:
                    raise ValueError(f"leaf {spec['name'][:80]!r} is in {part[0][:80]!r}, which the manifest does not list")
            for key in ("global_shape", "offset", "shape"):
                value = spec.get(key, [])
                if not (isinstance(value, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                        for x in value)):
                    raise ValueError(f"leaf {spec['name'][:80]!r}: {key} is not a list of non-negative integers")
            if spec["kind"] == "sharded" and not (len(spec.get("global_shape", [])) == len(spec.get("offset", []))
                                                  == len(spec["shape"])):
                raise ValueError(f"leaf {spec['name'][:80]!r}: shape, global_shape and offset differ in length")
        files = {}
        for short, digests in blocks.items():
            if not isinstance(digests, list) or not all(isinstance(d, str) for d in digests):
                raise ValueError(f"the block checksums of {str(short)[:80]!r} are malformed")
            files[f"{prefix}{short}"] = digests
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where}: malformed ({str(e)[:300]})", path=where) from e
    return RankSkeleton(rank, doc["tree"], table, leaves, block_size, files)
