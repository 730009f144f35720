"""The resharding read plan of a multi-rank checkpoint: regions of global tensors, block-verified.

Every rank's skeleton (``skeleton``) is read first; together they index each global tensor
(a DTensor's shards, a replicated tensor's one copy) by name. A reader then asks for
*regions*: a box of a global tensor (all of it for a plain tensor, one shard's box for a
DTensor of the job that restores). Each stored chunk that overlaps the box is read as the one
contiguous byte span (in the chunk's row-major order) that covers the overlap, viewed with the
chunk's strides and copied into place: for shards along dimension 0, the usual FSDP layout,
that is exactly the bytes needed, so a rank reads about its share of the checkpoint, whatever
the world size it was saved at.

Nothing is trusted unverified: every byte range is read in whole blocks whose xxh3-64 the
skeleton lists (``BLOCK_BYTES``, at most two partial blocks of overread per range), every
file's size is checked against the manifest and safetensors headers are validated before an
offset in them is used (``verified``). The chunks of a region must cover it exactly once, or
the checkpoint is reported damaged. ``ranked`` builds states from the regions.
"""

from __future__ import annotations

import collections
import functools
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from mpckpt import _dtypes
from mpckpt._progress import reading_bar
from mpckpt._read.skeleton import Skeleton, read_rank_skeletons
from mpckpt._read.sources import Source
from mpckpt._read.verified import checked_size, memory, read_header
from mpckpt._threads import executor
from mpckpt.errors import CorruptCheckpointError
from mpckpt.format.checksums import checksum
from mpckpt.format.safetensors import ITEMSIZE, ParsedHeader

_WINDOW = 64 << 20  # most bytes one request reads (and one thread holds)
_KEPT_BLOCKS = 64   # verified boundary blocks kept for neighbouring ranges (16 MiB at the default block size)


@dataclass
class Chunk:
    """The bytes one rank stored of a tensor: a box of the global tensor, row-major."""

    rank: int
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    parts: list[tuple[str, str, int, int]]  # (file, safetensors key, first element, end or -1)


@dataclass
class _Global:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: list[Chunk] = field(default_factory=list)


class _Files:
    """The shard files of one checkpoint; every read is checked block by block."""

    def __init__(self, source: Source, skeletons: list[Skeleton]) -> None:
        self.source, self.name = source, source.name
        self.blocks = {file: (sk.block_size, digests) for sk in skeletons for file, digests in sk.blocks.items()}
        self.bytes_read = 0
        self._lock = threading.Lock()
        self._headers: dict[str, ParsedHeader] = {}
        self._sizes: dict[str, int] = {}
        self._blocks_kept: collections.OrderedDict[tuple[str, int], bytes] = collections.OrderedDict()

    def _size(self, file: str) -> int:
        size = self._sizes.get(file)
        if size is None:
            size = checked_size(self.source, file)
            block_size, digests = self._blocks(file)
            if len(digests) != -(-size // block_size):
                raise CorruptCheckpointError(f"{self.source.location(file)}: the skeleton lists {len(digests)} block "
                                             f"checksums for {size} bytes", path=self.source.location(file))
            self._sizes[file] = size
        return size

    def _blocks(self, file: str) -> tuple[int, list[str]]:
        found = self.blocks.get(file)
        if found is None:
            raise CorruptCheckpointError(f"{self.name}/{file}: no skeleton lists its block checksums",
                                         path=f"{self.name}/{file}")
        return found

    def read_into(self, file: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with bytes ``[offset, offset + len(out))`` of ``file``, verified.

        The blocks that lie wholly inside the range are read straight into ``out`` (in windows
        of at most ``_WINDOW``) and hashed there; the at most two blocks at its ends, which a
        neighbouring range (a small tensor beside it) also needs, are read whole, verified and
        kept in a small cache, so ranges that share a block read it once.
        """
        size = self._size(file)
        location = self.source.location(file)
        if offset < 0 or offset + len(out) > size:
            raise CorruptCheckpointError(f"{location}: bytes [{offset}, {offset + len(out)}) asked of a file of {size}",
                                         path=location)
        block_size, digests = self._blocks(file)
        end = offset + len(out)
        window = max(1, _WINDOW // block_size)  # blocks
        k, stop = offset // block_size, -(-end // block_size)
        while k < stop:
            first = k * block_size
            if first < offset or min(first + block_size, size) > end:  # a block at an end of the range
                lo, hi = max(first, offset), min(first + block_size, end)
                self._from_block(file, location, k, lo - first, out[lo - offset:hi - offset])
                k += 1
                continue
            inner = k + 1  # the run of whole blocks from k: read in place, hashed there
            while inner < stop and inner - k < window and min((inner + 1) * block_size, size) <= end:
                inner += 1
            last = min(inner * block_size, size)
            view = out[first - offset:last - offset]
            self.source.read_into(file, first, view)
            for j in range(k, inner):
                self._check(location, j, view[(j - k) * block_size:(j - k + 1) * block_size], digests, block_size)
            with self._lock:
                self.bytes_read += last - first
            k = inner

    def _from_block(self, file: str, location: str, k: int, at: int, out: memoryview) -> None:
        """Fill ``out`` with bytes from ``at`` on of block ``k``, read whole and verified once."""
        block_size, digests = self._blocks(file)
        data = self._cached(file, k)
        if data is None:
            first = k * block_size
            buf = bytearray(min(block_size, self._size(file) - first))
            self.source.read_into(file, first, memoryview(buf))
            self._check(location, k, memoryview(buf), digests, block_size)
            data = bytes(buf)
            self._keep(file, k, data)
            with self._lock:
                self.bytes_read += len(buf)
        out[:] = data[at:at + len(out)]

    @staticmethod
    def _check(location: str, k: int, view: memoryview, digests: list[str], block_size: int) -> None:
        if checksum(view) != digests[k]:  # (xxhash releases the GIL)
            raise CorruptCheckpointError(f"{location}: block {k} (bytes {k * block_size}+) does not match its "
                                         "checksum; the file is damaged", path=location)

    def _cached(self, file: str, block: int) -> bytes | None:
        with self._lock:
            data = self._blocks_kept.get((file, block))
            if data is not None:
                self._blocks_kept.move_to_end((file, block))
            return data

    def _keep(self, file: str, block: int, data: bytes) -> None:
        with self._lock:
            self._blocks_kept[(file, block)] = data
            while len(self._blocks_kept) > _KEPT_BLOCKS:
                self._blocks_kept.popitem(last=False)

    def header(self, file: str) -> ParsedHeader:
        with self._lock:
            header = self._headers.get(file)
        if header is None:
            read = functools.partial(self.read_into, file)
            _, header = read_header(read, self._size(file), self.source.location(file))
            with self._lock:
                self._headers[file] = header
        return header


class Reader:
    """Regions of the tensors of one multi-rank checkpoint, read by a pool of threads."""

    def __init__(self, source: Source, *, threads: int = 8) -> None:
        self.name = source.name
        self.skeletons = read_rank_skeletons(source, threads=threads)
        self.files = _Files(source, self.skeletons)
        self.globals = self._index()
        self.threads = threads
        self._tasks: list[tuple[Chunk, int, Callable[[], int]]] = []  # (chunk, bytes of the box, read)
        self._regions: dict[tuple[Any, ...], torch.Tensor] = {}

    def _index(self) -> dict[str, _Global]:
        out: dict[str, _Global] = {}
        for sk in self.skeletons:
            for spec in sk.leaves:
                if spec["kind"] == "local":
                    continue
                dtype = leaf_dtype(self.name, spec)
                shape = tuple(spec["global_shape"] if spec["kind"] == "sharded" else spec["shape"])
                g = out.setdefault(spec["name"], _Global(spec["name"], dtype, shape))
                if (g.dtype, g.shape) != (dtype, shape):
                    raise CorruptCheckpointError(f"{self.name}: ranks disagree on tensor {spec['name'][:80]!r} "
                                                 f"({g.dtype} {list(g.shape)} vs {dtype} {list(shape)})")
                if "parts" in spec:
                    offset = tuple(spec["offset"]) if spec["kind"] == "sharded" else (0,) * len(shape)
                    g.chunks.append(Chunk(sk.rank, offset, tuple(spec["shape"]),
                                           [tuple(p) for p in spec["parts"]]))  # type: ignore[misc]
        return out

    # -- planning reads ----------------------------------------------------------------------
    def region(self, name: str, offset: tuple[int, ...] | None = None,
               shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """A tensor for the box ``offset``/``shape`` of global tensor ``name`` (default: all of
        it), filled by ``run``; the same box asked twice is one tensor."""
        g = self.globals.get(name)
        if g is None:
            raise CorruptCheckpointError(f"{self.name}: no rank stored tensor {name[:80]!r}")
        offset = offset if offset is not None else (0,) * len(g.shape)
        shape = shape if shape is not None else g.shape
        key = (name, offset, shape)
        tensor = self._regions.get(key)
        if tensor is None:
            tensor = torch.empty(shape, dtype=g.dtype)
            self.plan(tensor, offset, g.chunks, name)
            self._regions[key] = tensor
        return tensor

    def local(self, rank: int, spec: dict[str, Any]) -> torch.Tensor:
        """A leaf of ``rank``'s own (under a PerRank), whole."""
        if "parts" not in spec:
            raise CorruptCheckpointError(f"{self.name}: rank {rank} did not store its own tensor {spec['name'][:80]!r}")
        shape = tuple(spec["shape"])
        tensor = torch.empty(shape, dtype=leaf_dtype(self.name, spec))
        self.plan(tensor, (0,) * len(shape), [Chunk(rank, (0,) * len(shape), shape,
                                                      [tuple(p) for p in spec["parts"]])],  # type: ignore[misc]
                   spec["name"])
        return tensor

    def plan(self, dest: torch.Tensor, offset: tuple[int, ...], chunks: list[Chunk], name: str) -> None:
        shape = tuple(dest.shape)
        if any(not isinstance(n, int) for n in shape):
            raise CorruptCheckpointError(f"{self.name}: tensor {name[:80]!r} has a malformed shape")
        covered = 0
        for chunk in chunks:
            if len(chunk.offset) != len(shape) or len(chunk.shape) != len(shape):
                raise CorruptCheckpointError(f"{self.name}: a chunk of {name[:80]!r} has {len(chunk.shape)} "
                                             f"dimensions, the tensor {len(shape)}")
            lo = tuple(max(a, b) for a, b in zip(offset, chunk.offset, strict=True))
            hi = tuple(min(a + n, b + m) for a, n, b, m in zip(offset, shape, chunk.offset, chunk.shape, strict=True))
            if any(h <= low for low, h in zip(lo, hi, strict=True)) and shape:
                continue
            elements = math.prod(h - low for low, h in zip(lo, hi, strict=True))
            covered += elements
            self._tasks.append((chunk, elements * dest.element_size(),
                                functools.partial(self._copy, dest, offset, chunk, lo, hi, name)))
        if covered != math.prod(shape):
            raise CorruptCheckpointError(f"{self.name}: the stored chunks of tensor {name[:80]!r} cover {covered} of "
                                         f"the {math.prod(shape)} elements asked for; the checkpoint is incomplete")

    def forget_planned(self) -> None:
        """Drop the reads planned so far (``check_ranked`` plans on meta tensors to check coverage)."""
        self._tasks = []

    def run(self) -> int:
        """Read everything planned; return the bytes read so far.

        The reads of one file run in file order on one thread (files in parallel), so that a
        block two neighbouring ranges share is read once and then found in the cache of
        boundary blocks, never read twice by two threads at the same moment.
        """
        tasks, self._tasks = self._tasks, []
        by_file: dict[str, list[tuple[int, int, Callable[[], int]]]] = {}
        for chunk, nbytes, task in tasks:
            if not chunk.parts:
                raise CorruptCheckpointError(f"{self.name}: a rank's skeleton lists a tensor with no parts")
            file, key = chunk.parts[0][0], chunk.parts[0][1]
            entry = self.files.header(file).entries.get(key)
            by_file.setdefault(file, []).append((entry.start if entry is not None else -1, nbytes, task))

        def one_file(reads: list[tuple[int, int, Callable[[], int]]], bar: Any) -> None:
            for _, nbytes, task in sorted(reads, key=lambda r: r[0]):
                task()
                if bar is not None:
                    bar.update(nbytes)

        if by_file:
            total = sum(nbytes for reads in by_file.values() for _, nbytes, _ in reads)
            bar = reading_bar(total, f"mpckpt load {self.name}")
            try:
                with executor(self.threads, "mpckpt-read") as pool:
                    for future in [pool.submit(one_file, reads, bar) for reads in by_file.values()]:
                        future.result()
            finally:
                if bar is not None:
                    bar.close()
        return self.files.bytes_read

    # -- reading -------------------------------------------------------------------------------
    def _copy(self, dest: torch.Tensor, dest_offset: tuple[int, ...], chunk: Chunk, lo: tuple[int, ...],
              hi: tuple[int, ...], name: str) -> int:
        itemsize = dest.element_size()
        strides = _row_major(chunk.shape)
        first = sum((low - o) * s for low, o, s in zip(lo, chunk.offset, strides, strict=True))
        last = sum((h - 1 - o) * s for h, o, s in zip(hi, chunk.offset, strides, strict=True))
        shape = [h - low for low, h in zip(lo, hi, strict=True)]
        box = dest[tuple(slice(low - d, h - d) for low, h, d in zip(lo, hi, dest_offset, strict=True))]
        if last - first + 1 == math.prod(shape) and box.is_contiguous() and box.device.type == "cpu":
            # the overlap is one run of the chunk and of ``dest`` (a shard along dimension 0, a whole
            # tensor): read straight into place, no span and no copy
            self._read_chunk(chunk, first * itemsize, memory(box), name)
            return box.numel() * itemsize
        span = torch.empty((last - first + 1) * itemsize, dtype=torch.uint8)
        self._read_chunk(chunk, first * itemsize, memory(span), name)
        box.copy_(torch.as_strided(span.view(dest.dtype), shape, strides, 0))
        return span.numel()

    def _read_chunk(self, chunk: Chunk, start: int, out: memoryview, name: str) -> None:
        """Bytes ``[start, start + len(out))`` of the chunk (its parts are consecutive pieces)."""
        end = start + len(out)
        at = 0  # the chunk byte where the current part begins
        for file, key, first, last in chunk.parts:
            header = self.files.header(file)
            entry = header.entries.get(key)
            if entry is None:
                raise CorruptCheckpointError(f"{self.name}/{file}: tensor {key[:80]!r} is missing from the shard",
                                             path=f"{self.name}/{file}")
            size = entry.nbytes
            if last != -1 and (last - first) * ITEMSIZE[entry.dtype] != size:
                raise CorruptCheckpointError(f"{self.name}/{file}: part {key[:80]!r} of {name[:80]!r} holds {size} "
                                             "bytes, the skeleton says otherwise", path=f"{self.name}/{file}")
            lo, hi = max(start, at), min(end, at + size)
            if lo < hi:
                self.files.read_into(file, header.header_len + entry.start + (lo - at), out[lo - start:hi - start])
            at += size
        if at < end:
            raise CorruptCheckpointError(f"{self.name}: the parts of tensor {name[:80]!r} hold {at} bytes, fewer than "
                                         f"its shape needs ({end})")


def _row_major(shape: tuple[int, ...]) -> list[int]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return strides[::-1]


def leaf_dtype(name: str, spec: dict[str, Any]) -> torch.dtype:
    try:
        return _dtypes.dtype_from_name(spec["dtype"])
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpointError(f"{name}: tensor {str(spec.get('name'))[:80]!r} has a bad dtype ({e})") from e
