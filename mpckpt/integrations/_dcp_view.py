"""One committed mpckpt checkpoint as DCP sees it: its ``Metadata``, rebuilt, and its reads.

DCP's ``Metadata`` is not stored: ``CheckpointView`` rebuilds it from what mpckpt stores,
so that any state checkpoint reads through ``StorageReader``, whoever wrote it (DCP through
``StorageWriter``, or ``Checkpointer.save`` of one process or of a job):

* the state's tree comes from the skeleton (a job's: the reading rank's skeleton at the same
  world size, else rank 0's), every tensor as a meta placeholder, so nothing is read yet;
* DCP's own ``flatten_state_dict`` of that tree gives the fqns and the ``planner_data``
  (mappings) DCP would have made of the same state, so the fqns match what DCP's load planner
  asks for;
* a tensor's ``TensorStorageMetadata`` lists the chunks the ranks stored (a DTensor's or DCP's
  shards, a replicated tensor's one copy) with their global offsets; every other value is
  ``BytesStorageMetadata``.

Reading (``read``): a tensor item is the box of its global tensor that DCP's load planner asks
for (the stored chunk's offset plus the item's offsets), read by ``_read.regions`` from the
chunks that overlap it, every block verified against its checksum; then copied into the
tensor the planner resolves. A bytes item is the decoded value, serialized here with
``torch.save`` for DCP's ``load_bytes``: DCP unpickles only what this process just pickled,
never bytes from storage. A checkpoint one process saved is loaded whole (verified) by every
rank that reads it, then cut into the boxes asked for. A ``PerRank`` value goes back to the
same rank of a job of the same world size; at another world size asking for it is a
``StateError`` naming the key.
"""

from __future__ import annotations

import io
import math
from typing import Any

import torch

from mpckpt.errors import ConfigError, CorruptCheckpointError, StateError
from mpckpt.extension import RegionReader as Reader
from mpckpt.extension import Source, leaf_dtype
from mpckpt.extension import build_tree as build
from mpckpt.extension import load_tree as load_state


class _Elsewhere:
    """A ``PerRank`` value that cannot go to this rank (the job's world size differs)."""

    def __init__(self, path: str, saved: int, world: int) -> None:
        self.path, self.saved, self.world = path, saved, world

    def error(self) -> StateError:
        return StateError(f"state key {self.path or '<root>'!r} is a PerRank value saved by {self.saved} ranks; this "
                          f"job has {self.world}: it goes back only to the same rank of a job of the same size; "
                          "leave it out of the state you load", key=self.path)


def _box(tensor: torch.Tensor, offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
    return tensor[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]


class CheckpointView:
    """The DCP ``Metadata`` of one checkpoint (``metadata``) and the reads of one load (``read``)."""

    def __init__(self, source: Source, *, rank: int, world_size: int, allow_pickle: bool) -> None:
        manifest = source.manifest
        if manifest.kind != "state":
            raise ConfigError(f"{source.name} is a directory checkpoint (files given to report()); DCP reads states")
        self.source, self.rank, self.allow_pickle = source, rank, allow_pickle
        self.reader: Reader | None = None
        self._whole: dict[str, Any] | None = None  # fqn -> value of the state loaded whole
        self._marks: dict[int, tuple[str, Any]] = {}  # id(placeholder) -> ("global", name) | ("local", spec)
        self._placeholders: list[torch.Tensor] = []  # kept alive: their ids stay theirs
        self._local: dict[str, torch.Tensor] = {}
        if manifest.ranked:
            tree = self._ranked_tree(world_size)
        else:  # one process saved it: every rank that reads it loads it whole
            tree = load_state(source, allow_pickle=allow_pickle)
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict

        flat, mappings = flatten_state_dict(tree)
        if not manifest.ranked:
            self._whole = flat
        self.sources: dict[str, tuple[str, Any]] = {}
        self.values: dict[str, Any] = {}
        self.metadata = self._metadata(flat, mappings)

    def _ranked_tree(self, world_size: int) -> Any:
        manifest = self.source.manifest
        self.reader = reader = Reader(self.source)
        same = manifest.world_size == world_size
        sk = reader.skeletons[self.rank if same else 0]
        leaves = []
        for spec in sk.leaves:
            if spec["kind"] == "local":
                t = torch.empty(spec["shape"], dtype=leaf_dtype(reader.name, spec), device="meta")
                self._marks[id(t)] = ("local", spec)
            else:
                g = reader.globals.get(spec["name"])
                if g is None:
                    raise CorruptCheckpointError(f"{reader.name}: no rank stored tensor {spec['name'][:80]!r}")
                t = torch.empty(g.shape, dtype=g.dtype, device="meta")
                self._marks[id(t)] = ("global", spec["name"])
            leaves.append(t)
        self._placeholders = leaves

        def per_rank(number: int, value: Any, path: str) -> Any:
            return value if same else _Elsewhere(path, manifest.world_size, world_size)

        return build(sk, leaves, allow_pickle=self.allow_pickle, per_rank=per_rank)

    def _metadata(self, flat: dict[str, Any], mappings: Any) -> Any:
        from torch.distributed.checkpoint.metadata import (
            BytesStorageMetadata,
            ChunkStorageMetadata,
            Metadata,
            TensorProperties,
            TensorStorageMetadata,
        )

        found: dict[str, Any] = {}
        for fqn, obj in flat.items():
            if not isinstance(obj, torch.Tensor):
                self.values[fqn] = obj
                found[fqn] = BytesStorageMetadata()
                continue
            shape = tuple(obj.shape)
            whole = [ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)), sizes=torch.Size(shape))]
            mark = self._marks.get(id(obj)) if self.reader is not None else None
            if self.reader is None:
                self.sources[fqn], chunks = ("whole", obj), whole
            elif mark is None:  # a view of a tensor stored once for several views: read from the state, whole
                self.sources[fqn], chunks = ("derived", None), whole
            elif mark[0] == "local":
                self.sources[fqn], chunks = mark, whole
            else:
                self.sources[fqn] = mark
                stored = self.reader.globals[mark[1]].chunks
                chunks = [ChunkStorageMetadata(offsets=torch.Size(c.offset), sizes=torch.Size(c.shape))
                          for c in stored if math.prod(c.shape) > 0] or whole
            found[fqn] = TensorStorageMetadata(properties=TensorProperties(dtype=obj.dtype), size=torch.Size(shape),
                                               chunks=chunks)
        return Metadata(state_dict_metadata=found, planner_data=mappings)

    # -- reading -----------------------------------------------------------------------------
    def _whole_state(self) -> dict[str, Any]:
        if self._whole is None:
            from torch.distributed.checkpoint._nested_dict import flatten_state_dict

            self._whole, _ = flatten_state_dict(load_state(self.source, allow_pickle=self.allow_pickle))
        return self._whole

    def _region(self, fqn: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """The box ``offset``/``shape`` of ``fqn``'s tensor (filled once ``reader.run`` has run)."""
        how = self.sources.get(fqn)
        if how is None:
            raise StateError(f"{self.source.name} holds no tensor {fqn!r}", key=fqn)
        kind, what = how
        if kind == "global":
            assert self.reader is not None
            return self.reader.region(what, offset, shape)
        if kind == "local":
            assert self.reader is not None
            tensor = self._local.get(what["name"])
            if tensor is None:
                tensor = self._local[what["name"]] = self.reader.local(self.rank, what)
            return _box(tensor, offset, shape)
        tensor = what if kind == "whole" else self._whole_state()[fqn]
        return _box(tensor, offset, shape)

    def _value(self, fqn: str) -> Any:
        """The value of bytes item ``fqn``, tensors inside it read whole."""
        if fqn not in self.values:
            raise StateError(f"{self.source.name} holds no value {fqn!r}", key=fqn)
        value = self.values[fqn]
        if isinstance(value, _Elsewhere):
            raise value.error()
        if self.reader is None or not _holds_tensor(value):
            return value
        return self._whole_state()[fqn]

    def read(self, plan: Any, planner: Any) -> None:
        """Every item of DCP's load plan ``plan`` into the tensors and values ``planner`` resolves."""
        from torch.distributed.checkpoint.planner import LoadItemType

        pending: list[tuple[Any, torch.Tensor, torch.Tensor | None]] = []
        for item in plan.items:
            fqn = item.storage_index.fqn
            if item.type == LoadItemType.BYTE_IO:
                data = io.BytesIO()
                torch.save(self._value(fqn), data)  # what this process made, never storage's bytes
                data.seek(0)
                planner.load_bytes(item, data)
                continue
            chunk = item.storage_index.offset or ()
            offset = tuple(int(a) + int(b) for a, b in zip(chunk, item.storage_offsets, strict=True))
            shape = tuple(int(n) for n in item.lengths)
            target = planner.resolve_tensor(item).detach()
            if tuple(target.shape) != shape:
                raise StateError(f"{item.dest_index.fqn!r}: DCP asks for {list(shape)} into a tensor of "
                                 f"{list(target.shape)}", key=item.dest_index.fqn)
            if self._read_into(fqn, target, offset):
                pending.append((item, target, None))
            else:
                pending.append((item, target, self._region(fqn, offset, shape)))
        if self.reader is not None:
            self.reader.run()
        for item, target, region in pending:
            if region is not None:
                target.copy_(region)
            planner.commit_tensor(item, target)

    def _read_into(self, fqn: str, target: torch.Tensor, offset: tuple[int, ...]) -> bool:
        """Plan the read of a global tensor's box straight into DCP's ``target`` (same dtype, in CPU
        memory: the reader views the stored bytes as the target's dtype); False: read it apart."""
        how = self.sources.get(fqn)
        if self.reader is None or how is None or how[0] != "global" or target.device.type != "cpu":
            return False
        g = self.reader.globals[how[1]]
        if target.dtype != g.dtype:
            return False
        self.reader.plan(target, offset, g.chunks, how[1])
        return True


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_holds_tensor(v) for v in value)
    return False
