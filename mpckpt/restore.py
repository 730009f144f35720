"""Read, verify and load checkpoints (``_apply`` puts a loaded state back into live objects).

Loading never trusts storage: every file's size and xxh3 checksum is checked against the
manifest (which carries a checksum of its own), every safetensors header is validated
before its offsets are used, and the skeleton is plain JSON that is never evaluated.
Pickled values are refused unless the caller passes ``allow_pickle=True``.

How ``load_checkpoint`` reads a state:

1. the skeleton is read whole and verified; it names the shard entries that make each leaf;
2. each shard's size is checked and its header read (one request, usually) and validated;
3. every leaf gets memory of its own, and each shard becomes a *read plan*: chunks that tile
   the file after the header, in file order. A tensor of ``_SMALL`` bytes or more is read
   straight into its own memory, in pieces of at most ``_READ_CHUNK`` (one big tensor is read
   by several threads); smaller tensors, and entries no leaf uses, are read together into a
   scratch buffer (one request instead of hundreds) and copied out;
4. a thread pool reads the chunks of every shard; the calling thread hashes each file's
   header and chunks in file order as they arrive, so the checksum covers every byte, and
   compares it with the manifest. Only then are tensors built and handed out.

INVARIANT: a loaded tensor owns its memory; none is a view into a shard-sized buffer (C++
entry points such as ``torch.set_rng_state`` ignore storage offsets, a small tensor must not
keep a big buffer alive, ``torch.save`` writes whole storages). Tensors that shared storage
when saved share it again.

Files that are not unpacked into tensors (``mpckpt verify``, ``Checkpoint.to_directory``) go
through ``stream_verified``: read in order in chunks, never held whole. Nothing here uses
numpy, which torch does not require. A read that lasts more than a second draws a progress bar
on a terminal (``_progress``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from mpckpt import _dtypes
from mpckpt._codec.tree import build_tensors, unflatten
from mpckpt._progress import reading_bar
from mpckpt.errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError
from mpckpt.format.manifest import SKELETON_NAME, FileEntry, Manifest
from mpckpt.format.safetensors import ParsedHeader, header_length, parse_header
from mpckpt.format.skeleton import MAX_SKELETON_BYTES, SKELETON_VERSION
from mpckpt.storage import Backend

_READ_CHUNK = 64 << 20    # largest ranged read into tensor memory
_STREAM_CHUNK = 16 << 20  # stream_verified's buffers (two: one is read while the other is used)
_HEAD_BYTES = 64 << 10    # first read of a shard; holds the header unless it is a large one
_SMALL = 1 << 20          # tensors smaller than this are read together and copied out
_GATHER = 8 << 20         # most bytes one scratch read gathers


def _memory(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's own memory (numpy-free)."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")


# -- whole files, streamed -------------------------------------------------------------------

def _checked_size(backend: Backend, location: str, entry: FileEntry) -> int:
    try:
        size = backend.size(location)
    except CheckpointNotFoundError as e:
        raise CorruptCheckpointError(f"{location}: listed in the manifest but missing from storage", path=location) from e
    if size != entry.size:
        raise CorruptCheckpointError(
            f"{location}: {size} bytes on storage, the manifest says {entry.size}; the file is damaged", path=location
        )
    return size


def _check_digest(hasher: Any, entry: FileEntry, location: str) -> None:
    if hasher.hexdigest() != entry.checksum:
        raise CorruptCheckpointError(f"{location}: checksum does not match the manifest; the file is damaged",
                                     path=location)


def stream_verified(backend: Backend, name: str, manifest: Manifest, relpath: str,
                    sink: Callable[[memoryview], object] | None = None) -> None:
    """Read a file of a checkpoint in order, chunk by chunk, checking its size and checksum.

    ``sink`` gets each chunk (a view of a reused buffer: consume it before returning). The
    checksum is known only after the last chunk: until this returns, what ``sink`` got is
    unverified. One chunk is read ahead while the previous one is hashed and sunk.
    """
    entry = manifest.files[relpath]
    location = manifest.location(name, relpath)
    size = _checked_size(backend, location, entry)
    count = -(-size // _STREAM_CHUNK)
    buffers = [memoryview(bytearray(min(size, _STREAM_CHUNK))) for _ in range(min(count, 2))]

    def read(k: int) -> memoryview:
        start = k * _STREAM_CHUNK
        view = buffers[k % len(buffers)][:min(_STREAM_CHUNK, size - start)]
        backend.read_into(location, start, view)
        return view

    hasher = xxhash.xxh3_64()
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mpckpt-stream") as ahead:
        pending = ahead.submit(read, 0) if count else None
        for k in range(count):
            assert pending is not None
            view = pending.result()
            # INVARIANT: chunk k+1 goes to the other buffer, the one chunk k-1 is done with
            pending = ahead.submit(read, k + 1) if k + 1 < count else None
            hasher.update(view)
            if sink is not None:
                sink(view)
    _check_digest(hasher, entry, location)


def read_verified(backend: Backend, name: str, manifest: Manifest, relpath: str) -> bytes:
    """A whole small file of a checkpoint (the skeleton), after checking its size and checksum."""
    out = bytearray()
    stream_verified(backend, name, manifest, relpath, out.extend)
    return bytes(out)


# -- shards, read straight into the tensors' own memory ----------------------------------------

@dataclass
class _Chunk:
    """One ranged read. ``into`` is tensor memory; without it the read goes to scratch."""

    offset: int  # in the file
    length: int
    into: memoryview | None = None
    scatter: list[tuple[int, memoryview]] = field(default_factory=list)  # (offset in scratch, destination)


@dataclass
class _Shard:
    location: str
    entry: FileEntry
    head: bytes  # bytes [0, header.header_len) of the file, hashed first
    header: ParsedHeader
    wanted: dict[str, memoryview] = field(default_factory=dict)  # safetensors key -> where its bytes go


def _open_shard(backend: Backend, name: str, manifest: Manifest, relpath: str, bar: Any) -> _Shard:
    """Check a shard's size, read its header and validate it before any offset is used."""
    entry = manifest.files[relpath]
    location = manifest.location(name, relpath)
    size = _checked_size(backend, location, entry)
    head = bytearray(min(size, _HEAD_BYTES))
    backend.read_into(location, 0, memoryview(head))
    n = header_length(bytes(head[:8]), path=location, file_size=size)
    if 8 + n > len(head):
        rest = bytearray(8 + n - len(head))
        backend.read_into(location, len(head), memoryview(rest))
        head += rest
    del head[8 + n:]  # data bytes of a small file: the read plan reads them again
    header = parse_header(bytes(head), path=location, file_size=size)
    if bar is not None:
        bar.update(len(head))
    return _Shard(location, entry, bytes(head), header)


def _leaf(spec: dict[str, Any], shards: dict[str, _Shard], *, meta: bool = False) -> torch.Tensor:
    """Memory of its own for one leaf; tells its shards where each part's bytes go.

    With ``meta`` the leaf is a meta tensor (no memory, nothing to read): every check runs
    all the same, so ``verify_checkpoint`` knows that loading would work.
    """
    found = []
    for filename, key, start, end in spec["parts"]:
        shard = shards[filename]
        entry = shard.header.entries.get(key)
        if entry is None:
            raise CorruptCheckpointError(f"{shard.location}: tensor {key!r} is missing from the shard",
                                         path=shard.location)
        found.append((shard, entry, start, end))
    codes = {entry.dtype for _, entry, _, _ in found}
    if len(codes) != 1:
        raise ValueError(f"tensor {spec['name']!r} is stored as {sorted(codes) or 'nothing'}")
    whole = len(found) == 1 and found[0][3] == -1
    numel = 0
    for _, entry, start, end in found:  # parts are consecutive flat element ranges
        count = math.prod(entry.shape)
        if not whole and (start != numel or end - start != count):
            raise ValueError(f"part {entry.name!r} holds {count} elements for range [{start}, {end})")
        numel += count
    original = _dtypes.dtype_from_name(spec["dtype"])
    raw = bool(spec.get("raw"))
    real_shape = list(spec["shape"]) + ([2] if original in (torch.complex128, torch.complex32) else [])
    if not raw and numel != math.prod(real_shape):
        raise CorruptCheckpointError(f"tensor {spec['name']!r}: stored {numel} elements, expected shape {real_shape}")
    stored = torch.empty(numel, dtype=_dtypes.stored_dtype(codes.pop()), device="meta" if meta else "cpu")
    memory, at = (None if meta else _memory(stored)), 0
    for shard, entry, _, _ in found:
        if entry.name in shard.wanted:
            raise ValueError(f"{shard.location}: tensor {entry.name!r} is used twice")
        shard.wanted[entry.name] = memory[at:at + entry.nbytes] if memory is not None else memoryview(b"")
        at += entry.nbytes
    if raw:
        return stored
    tensor = _dtypes.from_stored(stored.view(real_shape), original)
    if tensor.dtype != original:
        raise ValueError(f"tensor {spec['name']!r} is stored as {stored.dtype}, not as {original}")
    return tensor


def _plan(shard: _Shard) -> list[_Chunk]:
    """Chunks tiling the file after the header, in file order (``parse_header`` checked that
    the entries tile the data section with no hole)."""
    chunks: list[_Chunk] = []
    gather: _Chunk | None = None
    for entry in sorted(shard.header.entries.values(), key=lambda e: e.start):
        dest = shard.wanted.get(entry.name)
        for lo in range(0, entry.nbytes, _READ_CHUNK):
            n = min(_READ_CHUNK, entry.nbytes - lo)
            offset = shard.header.header_len + entry.start + lo
            if dest is not None and entry.nbytes >= _SMALL:
                chunks.append(_Chunk(offset, n, dest[lo:lo + n]))
                gather = None
                continue
            if gather is None or gather.length + n > _GATHER:
                gather = _Chunk(offset, 0)
                chunks.append(gather)
            if dest is not None:
                gather.scatter.append((gather.length, dest[lo:lo + n]))
            gather.length += n
    return chunks


def _read_chunk(backend: Backend, location: str, chunk: _Chunk, bar: Any) -> memoryview:
    """Run one read; return the bytes it covered (for the hash, in file order)."""
    view = chunk.into if chunk.into is not None else memoryview(bytearray(chunk.length))
    backend.read_into(location, chunk.offset, view)
    for at, dest in chunk.scatter:
        dest[:] = view[at:at + len(dest)]
    if bar is not None:
        bar.update(len(view))
    return view


def _blame(backend: Backend, name: str, manifest: Manifest, shard_names: list[str]) -> None:
    """Raise the checksum error of a damaged shard, if one is: it explains a mismatch best."""
    for s in shard_names:
        stream_verified(backend, name, manifest, s)


def _read_leaves(backend: Backend, name: str, manifest: Manifest, leaves_spec: list[dict[str, Any]],
                 shard_names: list[str], *, threads: int) -> list[torch.Tensor]:
    """Every leaf in memory of its own, after every shard verified."""
    bar = reading_bar(sum(manifest.files[s].size for s in shard_names), f"mpckpt load {name}")
    pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="mpckpt-read")
    try:
        opened = pool.map(lambda s: _open_shard(backend, name, manifest, s, bar), shard_names)
        shards = dict(zip(shard_names, opened, strict=True))
        try:
            leaves = [_leaf(spec, shards) for spec in leaves_spec]
        except _MISMATCH as e:
            _blame(backend, name, manifest, shard_names)
            raise _skeleton_error(name, "its tensors do not match the shards", e) from e
        reads = [(shard, collections.deque(pool.submit(_read_chunk, backend, shard.location, c, bar)
                                           for c in _plan(shard))) for shard in shards.values()]
        for shard, futures in reads:
            hasher = xxhash.xxh3_64(shard.head)
            while futures:  # popped as hashed, so each scratch buffer goes as soon as it is hashed
                hasher.update(futures.popleft().result())
            _check_digest(hasher, shard.entry, shard.location)
    finally:
        # INVARIANT: no read is still running when this returns or raises (it writes into leaves)
        pool.shutdown(wait=True, cancel_futures=True)
        if bar is not None:
            bar.close()
    return leaves


def _skeleton_error(name: str, what: str, e: BaseException) -> CorruptCheckpointError:
    where = f"{name}/{SKELETON_NAME}"
    return CorruptCheckpointError(f"{where}: {what} ({str(e)[:300]})", path=where)


# what a hostile or damaged skeleton can make the interpretation of it raise
_MISMATCH = (CorruptCheckpointError, KeyError, IndexError, TypeError, ValueError, RuntimeError, OverflowError,
             RecursionError)


@dataclass
class Skeleton:
    tree: Any
    table: list[dict[str, Any]]
    leaves: list[dict[str, Any]]
    shard_names: list[str]


def read_skeleton(backend: Backend, name: str, manifest: Manifest) -> Skeleton:
    """The skeleton, size-bounded, verified and checked for shape before anything trusts it."""
    where = f"{name}/{SKELETON_NAME}"
    entry = manifest.files.get(SKELETON_NAME)
    if entry is None:
        raise CorruptCheckpointError(f"{name}: the manifest lists no {SKELETON_NAME}", path=where)
    if entry.size > MAX_SKELETON_BYTES:
        raise CorruptCheckpointError(f"{where}: the manifest says {entry.size} bytes, more than the "
                                     f"{MAX_SKELETON_BYTES} a skeleton may have; not read", path=where)
    raw = read_verified(backend, name, manifest, SKELETON_NAME)
    try:
        doc = json.loads(raw)
        version = doc["version"]
        if isinstance(version, bool) or not isinstance(version, int):
            raise ValueError(f"version {str(version)[:40]!r} is not an integer")
        if version > SKELETON_VERSION:
            raise CorruptCheckpointError(f"{where}: skeleton version {str(version)[:40]} is newer than this mpckpt",
                                         path=where)
        leaves, table = doc["leaves"], doc["table"]
        if not isinstance(leaves, list) or not isinstance(table, list):
            raise ValueError("leaves and table must be lists")
        for spec in leaves:
            parts = spec["parts"]
            if not isinstance(spec["name"], str) or not isinstance(parts, list) or not all(
                    isinstance(p, list) and len(p) == 4 and isinstance(p[0], str) and isinstance(p[1], str)
                    and all(isinstance(x, int) and not isinstance(x, bool) for x in p[2:]) for p in parts):
                raise ValueError(f"leaf {str(spec.get('name'))[:80]!r} has malformed parts")
        shard_names = sorted({part[0] for spec in leaves for part in spec["parts"]})
    except CorruptCheckpointError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise _skeleton_error(name, "malformed", e) from e
    missing = [s for s in shard_names if s not in manifest.files]
    if missing:
        raise CorruptCheckpointError(f"{where} names shard {missing[0][:300]!r}, which the manifest does not list",
                                     path=where)
    return Skeleton(doc["tree"], table, leaves, shard_names)


def _build(name: str, skeleton: Skeleton, leaves: list[torch.Tensor], *, allow_pickle: bool,
           check_only: bool = False, classes: bool = True) -> Any:
    try:
        tensors = build_tensors(skeleton.table, leaves)
        return unflatten(skeleton.tree, tensors, allow_pickle=allow_pickle, check_only=check_only, classes=classes)
    except CorruptCheckpointError as e:
        raise _skeleton_error(name, "malformed", e) from e


def load_checkpoint(backend: Backend, name: str, manifest: Manifest, *, allow_pickle: bool = False,
                    threads: int = 8, classes: bool = True) -> Any:
    """The plain nested state of checkpoint ``name``, every file verified (``classes``: see ``unflatten``)."""
    if manifest.kind != "state":
        raise ConfigError(
            f"{name} is a directory checkpoint (files you wrote); read it with Checkpointer.checkpoint(step).as_directory()"
        )
    if manifest.ranked:  # saved by the ranks of a job: every rank's part, joined
        from mpckpt._dist.reading import load_ranked

        return load_ranked(backend, name, manifest, allow_pickle=allow_pickle, classes=classes, threads=threads)
    skeleton = read_skeleton(backend, name, manifest)
    leaves = _read_leaves(backend, name, manifest, skeleton.leaves, skeleton.shard_names, threads=threads)
    return _build(name, skeleton, leaves, allow_pickle=allow_pickle, classes=classes)


def verify_checkpoint(backend: Backend, name: str, manifest: Manifest) -> None:
    """Check that checkpoint ``name`` would load, in bounded memory: every file's size and
    checksum (streamed), and for a state the skeleton, every shard header and how they fit
    together (with meta tensors: nothing is allocated, nothing is unpickled)."""
    if manifest.ranked:
        from mpckpt._dist.reading import check_ranked

        check_ranked(backend, name, manifest)
    elif manifest.kind == "state":
        skeleton = read_skeleton(backend, name, manifest)
        shards = {s: _open_shard(backend, name, manifest, s, None) for s in skeleton.shard_names}
        try:
            leaves = [_leaf(spec, shards, meta=True) for spec in skeleton.leaves]
        except _MISMATCH as e:
            raise _skeleton_error(name, "its tensors do not match the shards", e) from e
        _build(name, skeleton, leaves, allow_pickle=False, check_only=True)
    for rel in manifest.files:
        stream_verified(backend, name, manifest, rel)
