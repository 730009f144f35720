"""A plain torch.distributed.checkpoint (DCP) folder, read as a nested state of full tensors.

A folder ``dcp.save(sd, checkpoint_id=...)`` wrote with DCP's default ``FileSystemWriter`` (one
process or any number of ranks) holds ``.metadata`` (a pickle: what each key is, a tensor's
dtype, size and chunks, and where each item is: file, offset, length) and ``.distcp`` data
files, in which every item is ``torch.save``'d on its own: a tensor chunk, or a value that is
not a tensor (a "bytes" item).

Reading it runs no code from storage: the metadata goes through the restricted unpickler of
``format.dcp_metadata``, and every item through ``torch.load(weights_only=True)``, torch's own
restricted unpickler; a value that refuses is a ``StateError`` naming its key (with
``allow_pickle=True``, the caller's opt-in, such a bytes item is unpickled plainly).

What is verified: DCP stores no checksums, so bit rot inside an item that still decodes cannot
be found. What can be checked is: every item lies within its file (a truncated file is named
with the key it cuts off), every item decodes, every chunk has the dtype and the sizes the
metadata gives it, and a tensor's chunks lie within it and cover it exactly once.

The nested state is rebuilt from DCP's ``planner_data`` (each key's path: a string is a dict
key, an integer a list index), as DCP's own ``unflatten_state_dict`` does. DCP turns every
dict key into a string; an optimizer's ``state_dict`` (a dict with ``state`` and
``param_groups``) gets its parameter ids back as integers where its ``param_groups`` list
them, so ``optimizer.load_state_dict`` matches them again.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from mpckpt.errors import CorruptCheckpointError, StateError
from mpckpt.format.dcp_metadata import METADATA_NAME, is_dcp_folder, read_metadata
from mpckpt.storage import Backend

_MAX_METADATA_BYTES = 4 << 30  # far above any real model's; memory stays bounded whatever is stored
_MAX_OVERLAP_CHECKS = 1 << 20  # chunk pairs of one tensor compared for overlap, at most
_ZIP_MAGIC = b"PK\x03\x04"      # how every item torch.save writes begins

__all__ = ["DcpFolder", "is_dcp_folder", "load_dcp_folder"]


@dataclass
class Item:
    """One stored item: a tensor chunk (``offsets``/``sizes``) or a bytes value (``None``)."""

    key: str
    file: str
    start: int
    length: int
    offsets: tuple[int, ...] | None = None
    sizes: tuple[int, ...] | None = None


@dataclass
class Entry:
    """One key of the folder: a tensor (``dtype``, ``shape``, its chunks) or a value."""

    key: str
    path: tuple[str | int, ...]
    dtype: torch.dtype | None = None
    shape: tuple[int, ...] = ()
    items: list[Item] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        count = 1
        for n in self.shape:
            count *= n
        return count * (self.dtype.itemsize if self.dtype is not None else 0)


class DcpFolder:
    """The metadata of one DCP folder, checked; ``load`` and ``verify`` read its items."""

    def __init__(self, backend: Backend, *, allow_pickle: bool = False) -> None:
        self.backend = backend
        self.allow_pickle = allow_pickle
        where = self.where(METADATA_NAME)
        data = backend.read_bytes(METADATA_NAME, max_bytes=_MAX_METADATA_BYTES)
        self.metadata = read_metadata(data, where=where, allow_pickle=allow_pickle)
        self.entries = self._entries()

    def where(self, relpath: str) -> str:
        return f"{self.backend.url}/{relpath}"

    def _entries(self) -> list[Entry]:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        md = self.metadata
        planner = md.planner_data or {}
        # by plain values: the metadata's own records are of classes made for its load (format.dcp_metadata)
        stored = {(index.fqn, None if index.offset is None else tuple(index.offset)): info
                  for index, info in md.storage_data.items()}
        entries = []
        for key, meta in md.state_dict_metadata.items():
            entry = Entry(key, planner.get(key, (key,)))
            if isinstance(meta, TensorStorageMetadata):
                entry.dtype, entry.shape = meta.properties.dtype, tuple(meta.size)
                chunks = [(tuple(c.offsets), tuple(c.sizes)) for c in meta.chunks]
                _check_cover(entry, chunks, self.where(METADATA_NAME))
                spans: list[tuple[Any, Any]] = list(chunks)
            else:
                spans = [(None, None)]
            for offsets, sizes in spans:
                info = stored.get((key, offsets))
                if info is None:
                    raise CorruptCheckpointError(
                        f"{self.where(METADATA_NAME)}: {key!r} has no stored item"
                        + (f" for its chunk at {list(offsets)}" if offsets is not None else ""),
                        path=self.where(METADATA_NAME))
                entry.items.append(Item(key, info.relative_path, info.offset, info.length, offsets, sizes))
            if entry.dtype is not None and sum(item.length for item in entry.items) < entry.nbytes:
                raise CorruptCheckpointError(  # before a whole tensor of that size is allocated
                    f"{self.where(METADATA_NAME)}: {key!r} claims {entry.nbytes} bytes, more than its stored items "
                    f"hold ({sum(item.length for item in entry.items)})", path=self.where(METADATA_NAME))
            entries.append(entry)
        return entries

    def files(self) -> dict[str, int]:
        """Every data file the metadata names, with its size; ``CorruptCheckpointError`` naming
        the file and the key when an item does not lie within its file (a truncated file)."""
        sizes: dict[str, int] = {}
        for entry in self.entries:
            for item in entry.items:
                if item.file not in sizes:
                    sizes[item.file] = self.backend.size(item.file)
                if item.start + item.length > sizes[item.file]:
                    where = self.where(item.file)
                    raise CorruptCheckpointError(
                        f"{where} is {sizes[item.file]} bytes, but {item.key!r} is stored at bytes "
                        f"{item.start}-{item.start + item.length}: the file is truncated or not the one "
                        f"{METADATA_NAME} was written with; copy the folder again from where it was written",
                        path=where)
        return sizes

    def load(self) -> dict[str, Any]:
        """The nested state, every tensor whole (its chunks assembled)."""
        self.files()
        state: dict[str, Any] = {}
        for entry in self.entries:
            _place(state, entry, self._value(entry), self.where(METADATA_NAME), len(self.entries))
        _optimizer_keys(state)
        return state

    def verify(self) -> int:
        """Read and check every item without building the state; the number of items."""
        self.files()
        count = 0
        for entry in self.entries:
            for item in entry.items:
                self._read_item(entry, item)
                count += 1
        return count

    def _value(self, entry: Entry) -> Any:
        if entry.dtype is None:
            return self._read_item(entry, entry.items[0])
        if len(entry.items) == 1 and entry.items[0].sizes == entry.shape:
            return self._read_item(entry, entry.items[0])
        whole = torch.empty(entry.shape, dtype=entry.dtype)
        for item in entry.items:
            assert item.offsets is not None and item.sizes is not None
            region = tuple(slice(o, o + n) for o, n in zip(item.offsets, item.sizes, strict=True))
            whole[region] = self._read_item(entry, item)
        return whole

    def _read_item(self, entry: Entry, item: Item) -> Any:
        where = self.where(item.file)
        buf = bytearray(item.length)
        self.backend.read_into(item.file, item.start, memoryview(buf))
        value = self._unpickle(buf, entry, item, where)
        if entry.dtype is None:
            return value
        if not isinstance(value, torch.Tensor) or value.dtype != entry.dtype or tuple(value.shape) != item.sizes:
            got = f"{value.dtype} {list(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise CorruptCheckpointError(
                f"{where}: the chunk of {item.key!r} at {list(item.offsets or ())} holds {got}, not the "
                f"{entry.dtype} {list(item.sizes or ())} {METADATA_NAME} says", path=where)
        return value

    def _unpickle(self, buf: bytearray, entry: Entry, item: Item, where: str) -> Any:
        if buf[:4] != _ZIP_MAGIC:  # torch.save's archive; anything else is damage, never a legacy pickle to try
            raise self._undecodable(item, where, "not a torch.save archive; a folder written with "
                                    "serialization_format=SAFETENSORS is not read")
        try:
            return torch.load(io.BytesIO(buf), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            if "Unsupported" not in str(e):  # not a refused global or opcode: damaged bytes
                raise self._undecodable(item, where, f"{type(e).__name__}: {_first_line(e)}") from e
            if entry.dtype is None and self.allow_pickle:
                return self._unpickle_trusted(buf, item, where)
            raise StateError(
                f"{where}: the value of key {item.key!r} is not one torch.load(weights_only=True) accepts, so "
                "mpckpt did not unpickle it (that could run code from storage). If you trust whoever wrote this "
                "folder, pass allow_pickle=True (mpckpt.load) or --allow-pickle (mpckpt import-dcp); "
                f"torch said: {_first_line(e)}", key=item.key) from e
        except Exception as e:  # a damaged zip, a short item: whatever torch.load raises on bad bytes
            raise self._undecodable(item, where, f"{type(e).__name__}: {_first_line(e)}") from e

    def _undecodable(self, item: Item, where: str, why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{where}: the item of {item.key!r} at byte {item.start} ({item.length} bytes) does not decode ({why}); "
            "DCP stores no checksums, so the file was changed or damaged after it was written: copy the folder "
            "again from where it was written", path=where)

    def _unpickle_trusted(self, buf: bytearray, item: Item, where: str) -> Any:
        try:
            return torch.load(io.BytesIO(buf), map_location="cpu", weights_only=False)
        except Exception as e:
            raise CorruptCheckpointError(f"{where}: the value of {item.key!r} does not unpickle "
                                         f"({type(e).__name__}: {_first_line(e)})", path=where) from e


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:300]


def _check_cover(entry: Entry, chunks: list[tuple[tuple[int, ...], tuple[int, ...]]], where: str) -> None:
    """The chunks of a tensor lie within it and cover it exactly once."""
    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: the chunks of {entry.key!r} {what}", path=where)

    numel = 1
    for n in entry.shape:
        numel *= n
    total = 0
    for offsets, sizes in chunks:
        if any(o + n > dim for o, n, dim in zip(offsets, sizes, entry.shape, strict=True)):
            raise bad(f"reach past its shape {list(entry.shape)} (a chunk at {list(offsets)} of {list(sizes)})")
        volume = 1
        for n in sizes:
            volume *= n
        total += volume
    if total != numel or (numel and not chunks):
        raise bad(f"hold {total} elements, not the {numel} of its shape {list(entry.shape)}")
    # a sweep along the first dimension: only chunks whose first-dimension ranges meet are compared
    nonempty = sorted((c for c in chunks if all(c[1])), key=lambda c: c[0][:1])
    budget = _MAX_OVERLAP_CHECKS
    for i, (oa, sa) in enumerate(nonempty):
        for ob, sb in nonempty[i + 1:]:
            if oa and ob[0] >= oa[0] + sa[0]:
                break
            budget -= 1
            if budget < 0:  # a layout no planner makes: the element count above is what is checked
                return
            if all(a < b + m and b < a + n for a, n, b, m in zip(oa, sa, ob, sb, strict=True)):
                raise bad(f"overlap (at {list(oa)} and {list(ob)})")


def _place(state: dict[str, Any], entry: Entry, value: Any, where: str, keys: int) -> None:
    """Put ``value`` at ``entry.path`` in ``state`` (a string: a dict key; an integer: a list index)."""
    limit = max(1024, 16 * keys)  # a list index beyond this is a forged path, not a state

    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: the path of {entry.key!r} {list(entry.path)} {what}", path=where)

    node: Any = state
    path = entry.path
    for depth, part in enumerate(path):
        if isinstance(part, int):
            if not isinstance(node, list) or part >= limit:
                raise bad("indexes something that is not a list" if part < limit else "has an index too large")
            node.extend([None] * (part + 1 - len(node)))
            taken = node[part] is not None
        elif isinstance(node, dict):
            taken = part in node
        else:
            raise bad("names a key of something that is not a dict")
        if depth == len(path) - 1:
            if taken:
                raise bad("is given twice")
            node[part] = value
            return
        if not taken:
            node[part] = [] if isinstance(path[depth + 1], int) else {}
        node = node[part]


def _optimizer_keys(node: Any) -> None:
    """An optimizer's ``state`` keys back to the integer ids its ``param_groups`` list (DCP made them strings)."""
    for child in _containers(node):
        state, groups = child.get("state"), child.get("param_groups")
        if not (isinstance(state, dict) and isinstance(groups, list) and state):
            continue
        ids = {str(p): p for g in groups if isinstance(g, dict) and isinstance(g.get("params"), list)
               for p in g["params"] if isinstance(p, int) and not isinstance(p, bool)}
        if all(isinstance(k, str) and k in ids for k in state):
            child["state"] = {ids[k]: v for k, v in state.items()}


def _containers(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _containers(value)
    elif isinstance(node, list):
        for value in node:
            yield from _containers(value)


def load_dcp_folder(backend: Backend, *, allow_pickle: bool = False) -> dict[str, Any]:
    """``mpckpt.load`` of a DCP folder: the nested state of full tensors."""
    return DcpFolder(backend, allow_pickle=allow_pickle).load()
