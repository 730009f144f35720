"""States from a multi-rank checkpoint: whole in one process, or what one rank of a job restores.

``load_ranked`` (``mpckpt.load``, ``mpckpt export``): full plain tensors, and a ``PerRank``
value as the list of every rank's value. ``load_ranked_for`` (a restore in a job): what one
rank needs, DTensors built on the live state's meshes and placements (``_codec.dtensor``),
each read as the region of its global tensor that this rank's shard covers (``regions``).
``check_ranked``: what ``verify`` checks beyond every file's checksum. ``shard_like_live``:
a checkpoint one process saved, restored into the DTensors of a job.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mpckpt._codec.dtensor import ShardInfo, as_dtensor, local_shape
from mpckpt._codec.values import path_of
from mpckpt._read.regions import Chunk, Reader, leaf_dtype
from mpckpt._read.skeleton import Skeleton, build
from mpckpt._read.sources import Source
from mpckpt.errors import CorruptCheckpointError, StateError
from mpckpt.per_rank import NOT_RESTORED, PerRank


def _tensors(reader: Reader, sk: Skeleton, global_leaf: Callable[[dict[str, Any]], torch.Tensor],
             local: bool) -> list[torch.Tensor]:
    leaves = []
    for spec in sk.leaves:
        if spec["kind"] != "local":
            leaves.append(global_leaf(spec))
        elif local:
            leaves.append(reader.local(sk.rank, spec))
        else:  # never handed out (its PerRank cannot be restored here): shape only
            leaves.append(torch.empty(spec["shape"], dtype=leaf_dtype(reader.name, spec), device="meta"))
    return leaves


def load_ranked(source: Source, *, allow_pickle: bool = False, classes: bool = True, threads: int = 8) -> Any:
    """The whole state of a multi-rank checkpoint as plain tensors (a PerRank: every rank's value)."""
    name = source.name
    reader = Reader(source, threads=threads)
    per_rank: list[list[torch.Tensor]] = [
        _tensors(reader, sk, lambda spec: reader.region(spec["name"]), local=True) for sk in reader.skeletons]
    reader.run()
    values: list[dict[int, Any]] = []
    for sk, leaves in zip(reader.skeletons, per_rank, strict=True):
        found: dict[int, Any] = {}
        if sk.rank:  # rank 0's tree is the one returned; the others give their PerRank values
            build(sk, leaves, allow_pickle=allow_pickle, classes=classes,
                   per_rank=lambda n, v, p, found=found: found.__setitem__(n, v))
        values.append(found)

    def every_rank(number: int, value: Any, path: str) -> list[Any]:
        out = [value]
        for rank in range(1, len(values)):
            if number not in values[rank]:
                raise CorruptCheckpointError(f"{name}: rank {rank} has no value for the PerRank at {path or '<root>'!r}")
            out.append(values[rank][number])
        return out

    return build(reader.skeletons[0], per_rank[0], allow_pickle=allow_pickle, classes=classes,
                  per_rank=every_rank)


def load_ranked_for(source: Source, *, rank: int, world_size: int, targets: dict[str, ShardInfo],
                    strict: bool = True, allow_pickle: bool = False, threads: int = 8) -> tuple[Any, int]:
    """What rank ``rank`` of a job of ``world_size`` restores: ``(state, bytes read)``.

    ``targets``: the live state's DTensors by leaf name; each gets its own shard of the saved
    tensor (resharded from however it was saved), built as a DTensor on the live mesh and
    placements. Other tensors come back whole. A PerRank value comes back to the same rank
    of a job of the same world size; otherwise ``StateError`` naming the key (``strict``) or
    it is left as it is.
    """
    manifest = source.manifest
    reader = Reader(source, threads=threads)
    same = manifest.world_size == world_size
    sk = reader.skeletons[rank if same else 0]

    def global_leaf(spec: dict[str, Any]) -> torch.Tensor:
        target = targets.get(spec["name"])
        g = reader.globals.get(spec["name"])
        if target is None or g is None:
            return reader.region(spec["name"])
        if tuple(target.global_shape) != g.shape:
            raise StateError(f"state key {spec['name']!r}: shape {list(g.shape)} in the checkpoint, "
                             f"{list(target.global_shape)} in memory", key=spec["name"])
        return reader.region(spec["name"], tuple(target.offset), local_shape(target))

    leaves = _tensors(reader, sk, global_leaf, local=same)
    read = reader.run()
    for i, spec in enumerate(sk.leaves):  # shards of the live DTensors become DTensors again
        target = targets.get(spec["name"])
        if target is not None and spec["kind"] != "local":
            leaves[i] = as_dtensor(leaves[i], target)

    def this_rank(number: int, value: Any, path: str) -> Any:
        if same:
            return PerRank(value)
        if not strict:
            return NOT_RESTORED
        raise StateError(f"state key {path or '<root>'!r} is a PerRank value saved by {manifest.world_size} ranks; "
                         f"this job has {world_size}. A PerRank value goes back only to the same rank of a job of the "
                         "same world size: restore with strict=False to leave it as it is", key=path)

    return build(sk, leaves, allow_pickle=allow_pickle, per_rank=this_rank), read


def check_ranked(source: Source) -> None:
    """What ``verify`` checks of a multi-rank checkpoint beyond every file's checksum: the
    skeletons, every shard header, that each part is where a skeleton says, that the chunks
    of every tensor cover it exactly, and every tree (nothing is allocated or unpickled)."""
    name = source.name
    reader = Reader(source)
    for g in reader.globals.values():
        reader.plan(torch.empty(g.shape, dtype=g.dtype, device="meta"), (0,) * len(g.shape), g.chunks, g.name)
        for chunk in g.chunks:
            _check_parts(reader, chunk, g.name)
    reader.forget_planned()
    for sk in reader.skeletons:
        leaves = []
        for spec in sk.leaves:
            if spec["kind"] == "local":
                chunk = Chunk(sk.rank, (), (), [tuple(p) for p in spec.get("parts", [])])  # type: ignore[misc]
                _check_parts(reader, chunk, spec["name"])
                leaves.append(torch.empty(spec["shape"], dtype=leaf_dtype(name, spec), device="meta"))
            else:
                g = reader.globals[spec["name"]]
                leaves.append(torch.empty(g.shape, dtype=g.dtype, device="meta"))
        build(sk, leaves, check_only=True, per_rank=lambda n, v, p: v)


def _check_parts(reader: Reader, chunk: Chunk, name: str) -> None:
    for file, key, _, _ in chunk.parts:
        if key not in reader.files.header(file).entries:
            raise CorruptCheckpointError(f"{reader.name}/{file}: tensor {key[:80]!r} of {name[:80]!r} is missing from "
                                         "the shard", path=f"{reader.name}/{file}")


def shard_like_live(loaded: Any, targets: dict[str, ShardInfo], path: str = "") -> Any:
    """A state loaded whole (a checkpoint one process saved), with each tensor whose dotted
    path is a live DTensor's replaced by this rank's shard of it, as a DTensor like the live one."""
    if isinstance(loaded, torch.Tensor):
        target = targets.get(path)
        if target is None:
            return loaded
        if tuple(loaded.shape) != tuple(target.global_shape):
            raise StateError(f"state key {path!r}: shape {list(loaded.shape)} in the checkpoint, "
                             f"{list(target.global_shape)} in memory", key=path)
        box = tuple(slice(o, o + n) for o, n in zip(target.offset, local_shape(target), strict=True))
        return as_dtensor(loaded[box].contiguous(), target)
    if isinstance(loaded, dict):
        return {k: shard_like_live(v, targets, path_of(path, k)) for k, v in loaded.items()}
    if isinstance(loaded, list):
        return [shard_like_live(v, targets, path_of(path, i)) for i, v in enumerate(loaded)]
    return loaded
