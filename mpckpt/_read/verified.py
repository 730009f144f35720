"""Reads that are checked before anything uses them: sizes, checksums, safetensors headers.

Every file of a checkpoint is read through a ``Source`` and checked against the manifest
(which carries a checksum of its own): its size before any offset is used (``checked_size``),
its xxh3-64 over every byte (``stream_verified``, and the read plans of ``whole``), and a
shard's safetensors header validated before its offsets are trusted (``read_header``). The
multi-rank reader (``regions``) checks ranges block by block against the block checksums its
skeleton lists, through the same size check and header read.

Files that are not unpacked into tensors (``mpckpt verify``, ``Checkpoint.to_directory``, the
skeleton) go through ``stream_verified``: read in order in chunks, never held whole. Nothing
here uses numpy, which torch does not require.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import torch

from mpckpt._read.sources import Source
from mpckpt._threads import executor
from mpckpt.errors import CheckpointNotFoundError, CorruptCheckpointError
from mpckpt.format import checksums
from mpckpt.format.safetensors import ParsedHeader, header_length, parse_header

STREAM_CHUNK = 16 << 20  # stream_verified's buffers (two: one is read while the other is used)
HEAD_BYTES = 64 << 10    # first read of a shard; holds the header unless it is a large one


def memory(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's own memory (numpy-free)."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")


def checked_size(source: Source, relpath: str) -> int:
    """The size of file ``relpath``, which must be the manifest's (``CorruptCheckpointError`` if not)."""
    entry = source.manifest.files[relpath]
    location = source.location(relpath)
    try:
        size = source.size(relpath)
    except CheckpointNotFoundError as e:
        raise CorruptCheckpointError(f"{location}: listed in the manifest but missing from storage", path=location) from e
    if size != entry.size:
        raise CorruptCheckpointError(
            f"{location}: {size} bytes on storage, the manifest says {entry.size}; the file is damaged", path=location
        )
    return size


def check_digest(hasher: Any, source: Source, relpath: str) -> None:
    """The checksum of every byte of ``relpath`` (hashed in file order) must be the manifest's, or
    one the source learns as the file's (a snapshot kept in memory whose checksums were not
    written yet: ``_keep.source.MemorySource.learn``)."""
    digest = hasher.hexdigest()
    learn = getattr(source, "learn", None)
    if digest != source.manifest.files[relpath].checksum and not (learn is not None and learn(relpath, digest)):
        location = source.location(relpath)
        raise CorruptCheckpointError(f"{location}: checksum does not match the manifest; the file is damaged",
                                     path=location)


def read_header(read: Callable[[int, memoryview], None], size: int, location: str) -> tuple[bytes, ParsedHeader]:
    """A shard's header, validated before any offset in it is used: ``(its bytes, parsed)``.

    ``read(offset, out)`` reads from the shard. The first read takes ``HEAD_BYTES`` (the
    header of all but a large one); the rest of a larger header is read after it.
    """
    head = bytearray(min(size, HEAD_BYTES))
    read(0, memoryview(head))
    n = header_length(bytes(head[:8]), path=location, file_size=size)
    if 8 + n > len(head):
        rest = bytearray(8 + n - len(head))
        read(len(head), memoryview(rest))
        head += rest
    del head[8 + n:]  # data bytes of a small file: the read plan reads them again
    return bytes(head), parse_header(bytes(head), path=location, file_size=size)


def stream_verified(source: Source, relpath: str, sink: Callable[[memoryview], object] | None = None) -> None:
    """Read a file of a checkpoint in order, chunk by chunk, checking its size and checksum.

    ``sink`` gets each chunk (a view of a reused buffer: consume it before returning). The
    checksum is known only after the last chunk: until this returns, what ``sink`` got is
    unverified. One chunk is read ahead while the previous one is hashed and sunk.
    """
    size = checked_size(source, relpath)
    count = -(-size // STREAM_CHUNK)
    buffers = [memoryview(bytearray(min(size, STREAM_CHUNK))) for _ in range(min(count, 2))]

    def read(k: int) -> memoryview:
        start = k * STREAM_CHUNK
        view = buffers[k % len(buffers)][:min(STREAM_CHUNK, size - start)]
        source.read_into(relpath, start, view)
        return view

    hasher = checksums.hasher()
    with executor(1, "mpckpt-stream") as ahead:
        pending = ahead.submit(read, 0) if count else None
        for k in range(count):
            assert pending is not None
            view = pending.result()
            # INVARIANT: chunk k+1 goes to the other buffer, the one chunk k-1 is done with
            pending = ahead.submit(read, k + 1) if k + 1 < count else None
            hasher.update(view)
            if sink is not None:
                sink(view)
    check_digest(hasher, source, relpath)


def read_verified(source: Source, relpath: str) -> bytes:
    """A whole small file of a checkpoint (a skeleton), after checking its size and checksum."""
    out = bytearray()
    stream_verified(source, relpath, out.extend)
    return bytes(out)
