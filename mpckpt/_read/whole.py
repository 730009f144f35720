"""Reading a checkpoint one process saved: each leaf whole, straight into memory of its own or
into the live tensor it restores.

1. the skeleton is read and verified (``skeleton``); it names the shard entries of each leaf;
2. each shard's size is checked and its header read and validated (``verified``);
3. every leaf gets memory of its own, or, in a restore, the memory of the live tensor it
   restores where ``live`` says that writing there is what applying would do; each shard
   becomes a *read plan*: chunks that tile
   the file after the header, in file order. A tensor of ``_SMALL`` bytes or more is read
   straight into its own memory, in pieces of at most ``_READ_CHUNK`` (one big tensor is read
   by several threads); smaller tensors, and entries no leaf uses, are read together into a
   scratch buffer (one request instead of hundreds) and copied out;
4. a thread pool reads the chunks of every shard; each file's header and chunks are hashed in
   file order by whichever reader completes the chunk the hash waits for (``_OrderedHash``), so
   the checksum covers every byte; the calling thread compares it with the manifest once every
   read has ended. Only then are tensors built and handed out.

INVARIANT: a loaded tensor owns its memory; none is a view into a shard-sized buffer (C++
entry points such as ``torch.set_rng_state`` ignore storage offsets, a small tensor must not
keep a big buffer alive, ``torch.save`` writes whole storages). Tensors that shared storage
when saved share it again. A leaf read in place is the user's own live tensor, as it was.

Reading in place skips the page faults of fresh memory and the copy of applying (a 1 GiB
model with Adam: reading into fresh tensors took ~330 ms, a read into touched memory ~85).
The bytes land before the checksum is known: a read that fails after any went into live
memory says so (``state_changed`` on its error; ``restore`` then tries the next source or
step, which overwrites every leaf again, or says the state is undefined). Fresh tensors are
plain ``torch.empty``: advising transparent huge pages on them (``madvise(MADV_HUGEPAGE)``)
was measured and left out: reading 1 GiB into fresh memory in a new process took a median of
~700 ms with it against ~330 ms without (this machine: THP madvise, 2 cores).

A read that lasts more than a second draws a progress bar on a terminal (``_progress``).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from mpckpt import _dtypes
from mpckpt._progress import reading_bar
from mpckpt._read.live import LiveLeaf, live_targets, staged_for_gpu
from mpckpt._read.skeleton import Skeleton, build, error, read_skeleton
from mpckpt._read.sources import Source
from mpckpt._read.verified import check_digest, checked_size, memory, read_header, stream_verified
from mpckpt._threads import executor
from mpckpt.errors import CorruptCheckpointError, add_note
from mpckpt.format.checksums import hasher
from mpckpt.format.safetensors import ParsedHeader

if TYPE_CHECKING:
    from mpckpt._codec.snapshot import FlatState

_READ_CHUNK = 64 << 20    # largest ranged read into tensor memory
_SMALL = 1 << 20          # tensors smaller than this are read together and copied out
_GATHER = 8 << 20         # most bytes one scratch read gathers

# what a hostile or damaged skeleton can make the interpretation of it raise
MISMATCH = (CorruptCheckpointError, KeyError, IndexError, TypeError, ValueError, RuntimeError, OverflowError,
            RecursionError)


@dataclass
class _Chunk:
    """One ranged read. ``into`` is tensor memory; without it the read goes to scratch."""

    offset: int  # in the file
    length: int
    into: memoryview | None = None
    scatter: list[tuple[int, memoryview]] = field(default_factory=list)  # (offset in scratch, destination)
    live: bool = False  # it writes into a live tensor of the state


@dataclass
class _Shard:
    relpath: str
    location: str
    head: bytes  # bytes [0, header.header_len) of the file, hashed first
    header: ParsedHeader
    wanted: dict[str, memoryview] = field(default_factory=dict)  # safetensors key -> where its bytes go
    live: set[str] = field(default_factory=set)  # the keys whose bytes go into live tensors


def _open_shard(source: Source, relpath: str, bar: Any) -> _Shard:
    """Check a shard's size, read its header and validate it before any offset is used."""
    size = checked_size(source, relpath)
    location = source.location(relpath)
    head, header = read_header(lambda offset, out: source.read_into(relpath, offset, out), size, location)
    if bar is not None:
        bar.update(len(head))
    return _Shard(relpath, location, head, header)


def _leaf(spec: dict[str, Any], shards: dict[str, _Shard], *, meta: bool = False,
          live: LiveLeaf | None = None, staged: torch.Tensor | None = None) -> torch.Tensor:
    """Memory of its own for one leaf (``staged``'s, page-locked, when it is stored alike), or
    ``live``'s when it is stored alike; tells its shards where each part's bytes go.

    With ``meta`` the leaf is a meta tensor (no memory, nothing to read): every check runs
    all the same, so ``check_whole`` knows that loading would work.
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
    code = codes.pop()
    if live is not None and (meta or raw or live.code != code or live.stored.numel() != numel):
        live = None
    dtype = _dtypes.stored_dtype(code)
    if staged is not None and (meta or live is not None or staged.dtype != dtype or staged.numel() != numel):
        staged = None
    stored = live.stored if live is not None else staged if staged is not None else torch.empty(
        numel, dtype=dtype, device="meta" if meta else "cpu")
    view, at = (None if meta else memory(stored)), 0
    for shard, entry, _, _ in found:
        if entry.name in shard.wanted:
            raise ValueError(f"{shard.location}: tensor {entry.name!r} is used twice")
        shard.wanted[entry.name] = view[at:at + entry.nbytes] if view is not None else memoryview(b"")
        if live is not None:
            shard.live.add(entry.name)
        at += entry.nbytes
    if raw:
        return stored
    if live is not None:
        return live.tensor
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
        live = entry.name in shard.live
        for lo in range(0, entry.nbytes, _READ_CHUNK):
            n = min(_READ_CHUNK, entry.nbytes - lo)
            offset = shard.header.header_len + entry.start + lo
            if dest is not None and entry.nbytes >= _SMALL:
                chunks.append(_Chunk(offset, n, dest[lo:lo + n], live=live))
                gather = None
                continue
            if gather is None or gather.length + n > _GATHER:
                gather = _Chunk(offset, 0)
                chunks.append(gather)
            if dest is not None:
                gather.scatter.append((gather.length, dest[lo:lo + n]))
                gather.live |= live
            gather.length += n
    return chunks


class _OrderedHash:
    """The checksum of one shard, fed in file order by whichever reader thread completes the
    chunk it waits for: hashing runs on the readers' threads, beside the reads, instead of on
    the calling thread after them (where, on few cores, it was the tail of every restore)."""

    def __init__(self, head: bytes, count: int) -> None:
        self.hasher = hasher(head)
        self.count = count      # chunks in the shard
        self.hashed = 0         # chunks hashed so far (in file order)
        self._ready: dict[int, memoryview] = {}
        self._busy = False      # a thread is hashing: it takes what arrives meanwhile
        self._lock = threading.Lock()

    def arrived(self, index: int, view: memoryview) -> None:
        """Chunk ``index`` was read: hash it and every chunk after it that is ready, unless
        another thread is doing so (it will)."""
        with self._lock:
            self._ready[index] = view
            if self._busy:
                return
            self._busy = True
        while True:
            with self._lock:
                if self.hashed not in self._ready:
                    self._busy = False
                    return
                view = self._ready.pop(self.hashed)  # (a scratch buffer goes once hashed)
            try:
                self.hasher.update(view)  # (xxhash releases the GIL)
            except BaseException:
                with self._lock:
                    self._busy = False
                raise
            with self._lock:
                self.hashed += 1


def _read_chunk(source: Source, relpath: str, chunk: _Chunk, bar: Any, wrote: threading.Event,
                hashed: _OrderedHash, index: int) -> None:
    """Run one read and hand the bytes it covered to the shard's checksum. ``wrote`` is set
    before a read that writes into live tensors starts."""
    if chunk.live:
        wrote.set()
    view = chunk.into if chunk.into is not None else memoryview(bytearray(chunk.length))
    source.read_into(relpath, chunk.offset, view)
    for at, dest in chunk.scatter:
        dest[:] = view[at:at + len(dest)]
    if bar is not None:
        bar.update(len(view))
    hashed.arrived(index, view)


def _read_leaves(source: Source, skeleton: Skeleton, *, threads: int, live: dict[int, LiveLeaf] | None = None,
                 staged: dict[int, torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Every leaf in memory of its own (``staged``'s, by leaf index, where given) or in its
    ``live`` tensor (by leaf index), after every shard verified."""
    names = skeleton.shard_names
    bar = reading_bar(sum(source.manifest.files[s].size for s in names), f"mpckpt load {source.name}")
    pool = executor(threads, "mpckpt-read")
    wrote = threading.Event()
    live = live or {}
    try:
        shards = dict(zip(names, pool.map(lambda s: _open_shard(source, s, bar), names), strict=True))
        try:
            staged = staged or {}
            leaves = [_leaf(spec, shards, live=live.get(i), staged=staged.get(i)) for i, spec in enumerate(skeleton.leaves)]
        except MISMATCH as e:
            for s in names:  # a damaged shard explains a mismatch best: its checksum error first
                stream_verified(source, s)
            raise error(skeleton.where, "its tensors do not match the shards", e) from e
        reads = []
        for shard in shards.values():
            chunks = _plan(shard)
            hashed = _OrderedHash(shard.head, len(chunks))
            reads.append((shard, hashed, [pool.submit(_read_chunk, source, shard.relpath, c, bar, wrote, hashed, i)
                                          for i, c in enumerate(chunks)]))
        for shard, hashed, futures in reads:
            for future in futures:
                future.result()
            assert hashed.hashed == hashed.count, (shard.relpath, hashed.hashed, hashed.count)  # every read ended
            check_digest(hashed.hasher, source, shard.relpath)
    except BaseException as e:
        pool.shutdown(wait=True, cancel_futures=True)  # (as below: every read that started has ended)
        if not wrote.is_set():
            raise
        said = _overwrote(e)
        if said is e:
            raise
        raise said from e
    finally:
        # INVARIANT: no read is still running when this returns or raises (it writes into leaves)
        pool.shutdown(wait=True, cancel_futures=True)
        if wrote.is_set():  # written behind torch's back: what compares versions (incremental saves) must see it
            torch.autograd.graph.increment_version([target.tensor for target in live.values()])
        if bar is not None:
            bar.close()
    return leaves


def _overwrote(e: BaseException) -> BaseException:
    """``e``, raised after bytes went into live tensors of the state, saying so (``state_changed``)."""
    what = "its bytes had gone into live tensors of the state before that was known"
    if type(e) is CorruptCheckpointError:
        e = CorruptCheckpointError(f"{e}; {what}", path=e.path)
    else:
        add_note(e, f"mpckpt: {what}")
    e.state_changed = True  # type: ignore[attr-defined]
    return e


def load_whole(source: Source, *, allow_pickle: bool = False, classes: bool = True, threads: int = 8,
               live: FlatState | None = None) -> Any:
    """The plain nested state of a checkpoint one process saved, every file verified.

    ``live``: the flattened live state of a restore; the leaves ``live_targets`` allows are read
    straight into its tensors (and are those tensors in what this returns); those whose live
    tensor is on a GPU are read into page-locked memory (``staged_for_gpu``).
    """
    skeleton = read_skeleton(source)
    targets = live_targets(skeleton, live) if live is not None else None
    staged = staged_for_gpu(skeleton, live) if live is not None and live.on_cuda else None
    leaves = _read_leaves(source, skeleton, threads=threads, live=targets, staged=staged)
    return build(skeleton, leaves, allow_pickle=allow_pickle, classes=classes)


def check_whole(source: Source) -> None:
    """What ``verify`` checks of such a checkpoint beyond every file's checksum: the skeleton,
    every shard header and how they fit together (meta tensors: nothing allocated or unpickled)."""
    skeleton = read_skeleton(source)
    shards = {s: _open_shard(source, s, None) for s in skeleton.shard_names}
    try:
        leaves = [_leaf(spec, shards, meta=True) for spec in skeleton.leaves]
    except MISMATCH as e:
        raise error(skeleton.where, "its tensors do not match the shards", e) from e
    build(skeleton, leaves, allow_pickle=False, check_only=True)
