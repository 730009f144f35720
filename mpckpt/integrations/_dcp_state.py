"""What a DCP save hands mpckpt: one rank's part of ``dcp.save`` as an ordinary mpckpt state.

``StorageWriter.write_data`` gets the plan DCP's planner made for this rank (the items this
rank writes, after DCP removed the copies other ranks write) and the planner that resolves
them; ``prepare_local_plan`` saw every item this rank holds before that. ``state_of`` turns the
held items into the state ``Checkpointer.save`` takes:

* a tensor item (a DTensor's or ShardedTensor's chunk, or a whole tensor) becomes a
  ``PlacedShard``: the chunk as a box of its global tensor, written by this rank only when it
  is in this rank's plan (DCP's deduplication decides, mpckpt's own planner is not asked and
  runs no collective). In a single process, where every chunk is the whole tensor, it is the
  plain tensor;
* a bytes item (DCP serializes every value that is not a tensor with ``torch.save``) becomes
  the value itself, taken from the planner before DCP serializes it (``lookup_object``), so it
  is stored as mpckpt stores values (JSON in the skeleton; an ``io.BytesIO``, DCP's raw bytes,
  as its bytes, handed back as an ``io.BytesIO`` at its position; a value mpckpt cannot store
  without pickle is refused, naming its key, unless the Checkpointer has ``allow_pickle=True``);
* the flat ``fqn -> value`` dict DCP works with is nested again by the planner's ``mappings``
  (DCP's own ``unflatten_state_dict``), so the checkpoint holds the state as the caller gave
  it to DCP: ``mpckpt.load`` returns it nested, and DCP's ``flatten_state_dict`` of what
  ``mpckpt.load`` returns gives back the same fqns.

A tensor leaf is named by its key path, the same on every rank, so the chunks of one global
tensor that the ranks store meet under one name in mpckpt's ranked format. That needs every
rank to hold the same fqns (FSDP, tensor parallel, DDP, HSDP): ``held_keys`` and ``check_same_keys``
compare them on DCP's coordinator and refuse a job whose ranks hold different ones
(pipeline stages) with an error naming the first key that differs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import torch

from mpckpt.errors import ConfigError, StateError
from mpckpt.extension import PlacedShard


def _object(planner: Any, item: Any) -> Any:
    """The value of bytes item ``item`` as the state holds it (before ``torch.save``)."""
    lookup = getattr(planner, "lookup_object", None)
    if callable(lookup):
        return lookup(item.index)
    data = planner.resolve_data(item)  # a custom planner: its own serialized bytes of this process's value
    data.seek(0)
    return torch.load(data, weights_only=False)


def state_of(held: Iterable[Any], writes: Iterable[Any], planner: Any, *,
             distributed: bool) -> tuple[Any, dict[Any, int]]:
    """This rank's state for ``Checkpointer.save`` and the bytes of each item it writes.

    ``held``: every item this rank holds (its local plan); ``writes``: the items of its final
    plan, the ones it stores.
    """
    from torch.distributed.checkpoint.planner import WriteItemType

    mine = {item.index for item in writes}
    flat: dict[str, Any] = {}
    sizes: dict[Any, int] = {}
    for item in held:
        fqn = item.index.fqn
        if fqn in flat:
            raise StateError(f"DCP's plan holds two chunks of {fqn!r} on this rank; mpckpt stores one box of a "
                             "tensor per rank: save it with DCP's FileSystemWriter, or as one DTensor per rank",
                             key=fqn)
        if item.type == WriteItemType.BYTE_IO:
            flat[fqn] = _object(planner, item)
            sizes[item.index] = 0
            continue
        tensor = planner.resolve_data(item).detach()  # a new object: every item is a row of its own
        chunk, size = item.tensor_data.chunk, tuple(item.tensor_data.size)
        offset = tuple(int(o) for o in chunk.offsets)
        if tuple(tensor.shape) != tuple(chunk.sizes):
            raise StateError(f"DCP resolved {fqn!r} to a tensor of shape {list(tensor.shape)}, its plan says "
                             f"{list(chunk.sizes)}", key=fqn)
        sizes[item.index] = tensor.numel() * tensor.element_size()
        if distributed:
            flat[fqn] = PlacedShard(tensor, size, offset, item.index in mine)
        elif any(offset) or tuple(tensor.shape) != size:
            raise StateError(f"{fqn!r} is a chunk of a larger tensor, in a Checkpointer of one process; open the "
                             "Checkpointer in the job's process group (every rank), as DCP saves", key=fqn)
        else:
            flat[fqn] = tensor
    mappings = getattr(planner, "mappings", None)
    if mappings and all(fqn in mappings for fqn in flat):
        from torch.distributed.checkpoint._nested_dict import unflatten_state_dict

        return unflatten_state_dict(flat, mappings), {i: n for i, n in sizes.items() if i in mine}
    return flat, {i: n for i, n in sizes.items() if i in mine}


def held_keys(items: Iterable[Any]) -> tuple[str, list[str]]:
    """What a rank tells DCP's coordinator of the fqns it holds: their digest, and the fqns."""
    keys = sorted({item.index.fqn for item in items})
    return hashlib.sha256("\n".join(keys).encode()).hexdigest(), keys


def check_same_keys(every: list[Any]) -> None:
    """``ConfigError`` naming the first fqn only some ranks hold (``every``: each rank's ``held_keys``,
    None for a rank whose plan DCP took from its cache)."""
    known = [(rank, held) for rank, held in enumerate(every) if held is not None]
    if len({digest for _, (digest, _) in known}) <= 1:
        return
    first, base_set = known[0][0], set(known[0][1][1])
    for rank, (_, keys) in known[1:]:
        other = set(keys)
        if other == base_set:
            continue
        only_here = sorted(base_set - other)
        key, holder, lacks = (only_here[0], first, rank) if only_here else (sorted(other - base_set)[0], rank, first)
        raise ConfigError(f"the ranks hold different keys: rank {holder} has {key!r}, rank {lacks} has not. mpckpt "
                          "stores a multi-rank checkpoint as one state whose tensors the ranks share (FSDP, tensor "
                          "parallel, DDP); for ranks that hold different parts of the model (pipeline stages), save "
                          "with DCP's FileSystemWriter, or give every rank every key")
