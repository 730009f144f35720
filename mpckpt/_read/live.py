"""Which leaves of a checkpoint a restore reads straight into the live tensors of the state.

A single-process restore flattens the live state as a save would (``_codec.snapshot.flatten``:
its ``sources`` are views of the live memory) and, for each checkpoint leaf that qualifies,
``whole`` reads the bytes into the memory of the live tensor instead of into a fresh tensor
that ``apply_state`` would then copy. A leaf qualifies only where writing there gives exactly
what applying would:

- the live leaf has the same name, dtype and shape, and is stored the same way (the same
  safetensors code: ``whole`` checks it against the shard header). A live leaf of the same
  name and another shape means another model, which applying refuses: then no leaf goes in
  place, and the state is found as it was;
- its memory is a contiguous, dense CPU tensor (no conjugate or negative bit, no inference
  tensor), not a byte range several views share (``raw``), and no other leaf's storage
  overlaps its storage;
- the checkpoint's leaf and the live one are held at the very same key paths, every one of
  them through plain containers (dict, OrderedDict, list, tuple, PerRank): what is applied at
  those paths is that tensor, and nothing else is applied into its memory. A tensor under a
  namedtuple, a dataclass or a numpy array is read fresh.

Every other leaf keeps the fresh path. The tensor handed to ``build`` for a live leaf is the
live tensor itself, so applying it costs nothing: torch's ``copy_`` returns at once for a
source with the same memory, shape, strides and dtype, and an optimizer's ``load_state_dict``
keeps the very moment objects it is given.

Nothing here trusts the skeleton: whatever it holds, a malformed one only means no live leaf
(the fresh path then names what is wrong with it).

A leaf whose live tensor is on a GPU cannot be read into in place; ``staged_for_gpu`` gives it
memory of its own in one page-locked buffer instead, so that applying it is an asynchronous
host-to-device copy at full speed (``apply``), not a copy from pageable memory that waits.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from mpckpt import _dtypes
from mpckpt._codec.values import TAG

if TYPE_CHECKING:
    from mpckpt._codec.snapshot import FlatState
    from mpckpt._read.skeleton import Skeleton

Path = tuple[Any, ...]
_MAPPINGS = ("dict", "odict")  # nodes with parallel ``k`` and ``v``: a path names the key


@dataclass(frozen=True)
class LiveLeaf:
    """Where one checkpoint leaf is read in place."""

    stored: torch.Tensor  # the live memory as it is stored: contiguous, on the CPU, the stored dtype, 1-D
    code: str             # its safetensors dtype code
    tensor: torch.Tensor  # what the read hands out: the live tensor itself (a view of it for complex128)


def live_targets(skeleton: Skeleton, flat: FlatState) -> dict[int, LiveLeaf]:
    """The checkpoint leaves (by index in ``skeleton.leaves``) that are read into live memory."""
    try:
        saved = _leaf_paths(skeleton.tree, skeleton.table, len(skeleton.leaves))
        specs = [(spec["name"], spec["dtype"], spec["shape"], bool(spec.get("raw"))) for spec in skeleton.leaves]
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, RecursionError):
        return {}
    live = _leaf_paths(flat.tree, flat.table, len(flat.leaves))
    usable = _usable(flat)
    by_name = {leaf.name: i for i, leaf in enumerate(flat.leaves)}
    out: dict[int, LiveLeaf] = {}
    for index, (name, dtype, shape, raw) in enumerate(specs):
        i = by_name.pop(name, None) if isinstance(name, str) else None  # popped: a live leaf takes one leaf
        if i is None or raw or flat.leaves[i].raw:
            continue
        leaf = flat.leaves[i]
        if not isinstance(shape, list) or shape != list(leaf.shape):
            return {}  # another model: applying refuses it (``StateError``) and finds the state as it was
        if dtype != _dtypes.dtype_name(leaf.dtype) or i not in usable or not saved[index] or saved[index] != live[i]:
            continue
        source = flat.sources[i]
        tensor = source if source.dtype == leaf.dtype else _dtypes.from_stored(source, leaf.dtype)
        out[index] = LiveLeaf(source.view(-1), leaf.code, tensor)
    return out


def _usable(flat: FlatState) -> set[int]:
    """Live leaves whose memory may take a leaf's bytes: dense CPU memory no other leaf's overlaps."""
    spans = []
    for i, (leaf, t) in enumerate(zip(flat.leaves, flat.sources, strict=True)):
        if t.device.type == "cpu" and leaf.nbytes:
            storage = t.untyped_storage()
            spans.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes(), i))
    spans.sort()
    overlapping: set[int] = set()
    active: list[tuple[int, int]] = []  # (end, leaf) of the spans that started before and have not ended
    for start, end, i in spans:
        while active and active[0][0] <= start:
            heapq.heappop(active)
        if active:  # (rare: two storages over the same bytes, torch.frombuffer, from_blob)
            overlapping.update([i, *(j for _, j in active)])
        heapq.heappush(active, (end, i))
    return {i for _, _, i in spans
            if i not in overlapping and not flat.leaves[i].raw and _dense(flat.sources[i], flat.leaves[i].nbytes)}


def _dense(t: torch.Tensor, nbytes: int) -> bool:
    return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout is torch.strided and t.is_contiguous()
            and not t.is_conj() and not t.is_neg() and not t.is_inference()
            and t.numel() * t.element_size() == nbytes)


def _leaf_paths(tree: Any, table: list[Any], count: int) -> list[frozenset[Path] | None]:
    """For each leaf, the key paths of ``tree`` that hold it; None for a leaf held anywhere else
    than through plain containers, or as a view of a shared byte range.

    Raises what a malformed tree or table raises (``live_targets`` then gives up).
    """
    found: list[set[Path] | None] = [set() for _ in range(count)]
    stack: list[tuple[Any, Path, bool]] = [(tree, (), True)]
    while stack:
        node, path, plain = stack.pop()
        if isinstance(node, list):
            stack.extend((v, (*path, i), plain) for i, v in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        tag = node.get(TAG)
        if tag == "tensor":
            row = table[_index(node["id"], len(table))]
            leaf = row.get("leaf")
            index = _index(row["view_of"] if leaf is None else leaf, count)
            held = found[index]
            if plain and leaf is not None and held is not None:
                held.add(path)
            else:
                found[index] = None
        elif tag in _MAPPINGS:
            keys, values = node["k"], node["v"]
            if len(keys) != len(values):
                raise ValueError("keys and values differ in number")
            stack.extend((v, (*path, ("key", k)), plain) for k, v in zip(keys, values, strict=True))
        elif tag == "tuple":
            stack.extend((v, (*path, i), plain) for i, v in enumerate(node["v"]))
        elif tag == "per_rank":
            stack.append((node["v"], (*path, "per_rank"), plain))
        else:  # a namedtuple, a dataclass, a numpy array ...: what applying does there is its own
            stack.extend((v, path, False) for v in node.values())
    return [None if paths is None else frozenset(paths) for paths in found]


def _index(value: Any, count: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < count:
        raise ValueError(f"{str(value)[:40]!r} is not an index below {count}")
    return value


_STAGE_ALIGN = 64


def staged_for_gpu(skeleton: Skeleton, flat: FlatState) -> dict[int, torch.Tensor]:
    """For each checkpoint leaf (by index) whose live tensor of the same name, dtype and shape is
    on a CUDA device: 1-D memory of its stored dtype in one page-locked buffer, to read it into.
    Empty without CUDA, or when page-locked memory is refused."""
    if not torch.cuda.is_available():
        return {}
    by_name = {leaf.name: i for i, leaf in enumerate(flat.leaves) if flat.sources[i].is_cuda and not leaf.raw}
    wanted: list[tuple[int, torch.dtype, int, int]] = []  # (leaf index, stored dtype, elements, offset)
    total = 0
    try:
        for index, spec in enumerate(skeleton.leaves):
            i = by_name.get(spec["name"]) if isinstance(spec.get("name"), str) else None
            if i is None or spec.get("raw") or spec["shape"] != list(flat.leaves[i].shape):
                continue
            if spec["dtype"] != _dtypes.dtype_name(flat.leaves[i].dtype):
                continue
            dtype = _dtypes.stored_dtype(flat.leaves[i].code)
            numel = flat.sources[i].numel()
            wanted.append((index, dtype, numel, total))
            total += -(-numel * dtype.itemsize // _STAGE_ALIGN) * _STAGE_ALIGN
    except (KeyError, TypeError, AttributeError):
        return {}
    if not wanted:
        return {}
    try:
        buffer = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    except RuntimeError:
        return {}
    return {index: buffer[at:at + numel * dtype.itemsize].view(dtype) for index, dtype, numel, at in wanted}
