"""The one skeleton parser: a checkpoint's skeleton, bounded, verified and checked before use.

A checkpoint of one process has ``skeleton.json``; a multi-rank one has one per rank
(``r<rank>-skeleton.json``, see ``_stage.rank_skeleton`` for what a rank writes and
``format.skeleton`` for versions and limits). Both are read here the same way: the size the
manifest gives is bounded before anything is allocated, the bytes are verified against the
manifest's checksum, and the JSON is checked for shape (leaves, parts, and for a rank's
skeleton its rank, kinds, shapes and block checksums) before any reader trusts an index or
an offset in it. It is plain JSON, never evaluated.

``build`` turns a skeleton and its loaded leaves into the state (``_codec.tree``), naming
the skeleton file when what it says does not hold together.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch

from mpckpt._codec.tree import build_tensors, unflatten
from mpckpt._read.sources import Source
from mpckpt._read.verified import read_verified
from mpckpt._threads import executor
from mpckpt.errors import CorruptCheckpointError
from mpckpt.format.names import SKELETON_NAME, rank_prefix, rank_skeleton_name
from mpckpt.format.skeleton import KINDS, MAX_SKELETON_BYTES, RANK_SKELETON_VERSION, SKELETON_VERSION


@dataclass
class Skeleton:
    """A parsed skeleton: the tree, the tensor table, the leaves and the files they are in."""

    where: str                   # the skeleton file, as errors name it
    tree: Any
    table: list[dict[str, Any]]
    leaves: list[dict[str, Any]]
    shard_names: list[str]       # the files its leaves' parts are in
    rank: int = 0                # whose skeleton (a single process is rank 0)
    block_size: int = 0
    blocks: dict[str, list[str]] = field(default_factory=dict)  # file (with the rank prefix) -> block digests


def error(where: str, what: str, e: BaseException) -> CorruptCheckpointError:
    """A skeleton that does not hold together, named by its file."""
    return CorruptCheckpointError(f"{where}: {what} ({str(e)[:300]})", path=where)


def read_skeleton(source: Source) -> Skeleton:
    """The skeleton of a checkpoint one process saved."""
    return _parse(source, SKELETON_NAME, _read(source, SKELETON_NAME), rank=None)


def read_rank_skeletons(source: Source, *, threads: int = 8) -> list[Skeleton]:
    """Every rank's skeleton of a multi-rank checkpoint, in rank order."""
    world = source.manifest.world_size
    names = [rank_skeleton_name(r) for r in range(world)]
    for rel in names:
        if rel not in source.manifest.files:
            raise CorruptCheckpointError(f"{source.name}: saved by {world} ranks, but the manifest lists no {rel}",
                                         path=f"{source.name}/{rel}")
    with executor(min(threads, world), "mpckpt-skeleton") as pool:
        raws = list(pool.map(lambda rel: _read(source, rel), names))
    return [_parse(source, names[rank], raw, rank=rank) for rank, raw in enumerate(raws)]


def _read(source: Source, rel: str) -> bytes:
    where = f"{source.name}/{rel}"
    entry = source.manifest.files.get(rel)
    if entry is None:
        raise CorruptCheckpointError(f"{source.name}: the manifest lists no {rel}", path=where)
    if entry.size > MAX_SKELETON_BYTES:
        raise CorruptCheckpointError(f"{where}: the manifest says {entry.size} bytes, more than the "
                                     f"{MAX_SKELETON_BYTES} a skeleton may have; not read", path=where)
    return read_verified(source, rel)


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse(source: Source, rel: str, raw: bytes, *, rank: int | None) -> Skeleton:
    where = f"{source.name}/{rel}"
    manifest = source.manifest
    supported = SKELETON_VERSION if rank is None else RANK_SKELETON_VERSION
    try:
        doc = json.loads(raw)
        version = doc["version"]
        if not _int(version) or version < 1:
            raise ValueError(f"version {str(version)[:40]!r} is not a positive integer")
        if version > supported:
            raise CorruptCheckpointError(f"{where}: skeleton version {version} is newer than this mpckpt (it reads up "
                                         f"to {supported}); read it with a newer mpckpt", path=where)
        leaves, table = doc["leaves"], doc["table"]
        if not isinstance(leaves, list) or not isinstance(table, list):
            raise ValueError("leaves and table must be lists")
        block_size, blocks = 0, {}
        if rank is not None:
            if doc["rank"] != rank or doc["world_size"] != manifest.world_size:
                raise ValueError(f"it says rank {doc['rank']!r} of {doc['world_size']!r}")
            block_size = doc["block_size"]
            if not _int(block_size) or block_size <= 0:
                raise ValueError(f"block_size {str(block_size)[:20]!r} is not a positive integer")
            blocks = _blocks(doc["blocks"], rank_prefix(rank))
        for spec in leaves:
            _check_leaf(spec, manifest.files, rank)
        shard_names = sorted({part[0] for spec in leaves for part in spec.get("parts", [])})
    except CorruptCheckpointError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise error(where, "malformed", e) from e
    return Skeleton(where, doc["tree"], table, leaves, shard_names, rank or 0, block_size, blocks)


def _check_leaf(spec: Any, files: Any, rank: int | None) -> None:
    """One leaf's entry: a name, well-formed parts in files the manifest lists; for a rank's
    skeleton also its kind, its parts in that rank's files, and its shape and placement."""
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise ValueError(f"leaf {str(spec)[:80]} is malformed")
    name = spec["name"][:80]
    parts = spec["parts"] if rank is None else spec.get("parts", [])
    prefix = "" if rank is None else rank_prefix(rank)
    if not isinstance(parts, list):
        raise ValueError(f"leaf {name!r} has malformed parts")
    for part in parts:
        if not (isinstance(part, list) and len(part) == 4 and isinstance(part[0], str) and isinstance(part[1], str)
                and part[0].startswith(prefix) and all(_int(x) for x in part[2:])):
            raise ValueError(f"leaf {name!r} has malformed parts")
        if part[0] not in files:
            raise ValueError(f"leaf {name!r} is in {part[0][:300]!r}, which the manifest does not list")
    if rank is None:
        return
    if spec.get("kind") not in KINDS:
        raise ValueError(f"leaf {name!r} has kind {str(spec.get('kind'))[:20]!r}, not one of {KINDS}")
    for key in ("global_shape", "offset", "shape"):
        value = spec.get(key, [])
        if not (isinstance(value, list) and all(_int(x) and x >= 0 for x in value)):
            raise ValueError(f"leaf {name!r}: {key} is not a list of non-negative integers")
    if spec["kind"] == "sharded" and not (len(spec.get("global_shape", [])) == len(spec.get("offset", []))
                                          == len(spec["shape"])):
        raise ValueError(f"leaf {name!r}: shape, global_shape and offset differ in length")


def _blocks(blocks: Any, prefix: str) -> dict[str, list[str]]:
    if not isinstance(blocks, dict):
        raise ValueError("blocks is not an object")
    files = {}
    for short, digests in blocks.items():
        if not isinstance(digests, list) or not all(isinstance(d, str) for d in digests):
            raise ValueError(f"the block checksums of {str(short)[:80]!r} are malformed")
        files[f"{prefix}{short}"] = digests
    return files


def build(skeleton: Skeleton, leaves: list[torch.Tensor], **unflatten_args: Any) -> Any:
    """The state a skeleton describes, given its loaded leaves (``unflatten_args``: see ``unflatten``)."""
    try:
        return unflatten(skeleton.tree, build_tensors(skeleton.table, leaves), **unflatten_args)
    except CorruptCheckpointError as e:
        raise error(skeleton.where, "malformed", e) from e
