"""DTensors (FSDP2, tensor parallel) as mpckpt stores and restores them: by local shard.

A save stores each rank's local shard with where it sits in the global tensor
(``ShardInfo``); a restore reads the box of the global tensor that the live DTensor's shard
covers on this rank, then builds a DTensor like the live one around it (``as_dtensor``).
Only ``Shard`` and ``Replicate`` placements are stored; of the ranks that hold the same shard
(a replicated mesh dimension), the first one writes it.

``PlacedShard`` is the same thing without a DTensor: a plain tensor its caller placed in a
global tensor and said whether this rank writes (``integrations.dcp``: DCP's planner decided).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mpckpt.errors import StateError


@dataclass(frozen=True)
class ShardInfo:
    """Where a DTensor leaf's local shard sits in its global tensor, and whether this rank
    stores it (of the ranks holding the same shard, a replicated placement, only one does)."""

    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    writes: bool
    mesh: Any
    placements: tuple[Any, ...]
    global_stride: tuple[int, ...]


class PlacedShard:
    """A plain tensor stored like a DTensor's local shard: the box at ``offset`` of a global
    tensor of ``global_shape``, written by this rank when ``writes`` (the caller decided who
    writes what, so a multi-rank save of placed shards needs no plan of its own)."""

    __slots__ = ("info", "local")

    def __init__(self, local: torch.Tensor, global_shape: tuple[int, ...], offset: tuple[int, ...],
                 writes: bool) -> None:
        if len(global_shape) != local.dim() or len(offset) != local.dim() or any(
                o < 0 or o + n > g for o, n, g in zip(offset, local.shape, global_shape, strict=True)):
            raise StateError(f"a shard of shape {list(local.shape)} at {list(offset)} does not fit a tensor of shape "
                             f"{list(global_shape)}")
        self.local = local
        stride = [1] * len(global_shape)
        for d in range(len(global_shape) - 2, -1, -1):
            stride[d] = stride[d + 1] * max(global_shape[d + 1], 1)
        self.info = ShardInfo(tuple(global_shape), tuple(offset), writes, None, (), tuple(stride))


def is_dtensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ``torch.distributed`` DTensor (without importing that module)."""
    cls = type(t)
    return cls.__name__ == "DTensor" and cls.__module__.startswith("torch.distributed")


def shard_info(dt: Any, path: str) -> ShardInfo:
    """Where the local shard of DTensor ``dt`` (at state key ``path``) sits; ``StateError`` for
    a placement mpckpt does not store or a mesh this rank is not part of."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = dt.device_mesh, tuple(dt.placements)
    for p in placements:
        if type(p) not in (Shard, Replicate):
            raise StateError(f"state key {path!r} is a DTensor with placement {p}; mpckpt stores Shard and Replicate "
                             "placements: redistribute it (e.g. to Replicate or Shard(0)) before saving", key=path)
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise StateError(f"state key {path!r} is a DTensor on a device mesh this rank is not part of", key=path)
    local_shape, offset = compute_local_shape_and_global_offset(dt.shape, mesh, placements)
    if tuple(local_shape) != tuple(dt._local_tensor.shape):
        raise StateError(f"state key {path!r}: the DTensor's local shard has shape {tuple(dt._local_tensor.shape)}, "
                         f"its placements say {tuple(local_shape)}", key=path)
    writes = all(c == 0 for c, p in zip(coordinate, placements, strict=True) if isinstance(p, Replicate))
    return ShardInfo(tuple(dt.shape), tuple(int(o) for o in offset), writes, mesh, placements, tuple(dt.stride()))


def local_shape(target: ShardInfo) -> tuple[int, ...]:
    """The shape of this rank's shard of a DTensor like ``target``."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, _ = compute_local_shape_and_global_offset(target.global_shape, target.mesh, target.placements)
    return tuple(shape)


def as_dtensor(local: torch.Tensor, target: ShardInfo) -> torch.Tensor:
    """``local`` (read into CPU memory) as this rank's shard of a DTensor like the live one,
    on the live mesh's device."""
    from torch.distributed.tensor import DTensor

    device_type = target.mesh.device_type
    if device_type != "cpu":
        module = getattr(torch, device_type)
        local = local.to(torch.device(device_type, module.current_device()))
    return DTensor.from_local(local, target.mesh, target.placements, run_check=False,
                              shape=torch.Size(target.global_shape), stride=target.global_stride)
