"""xxh3-64, the one checksum of the format: every hasher mpckpt makes comes from here.

A manifest lists each file's xxh3-64 (its ``checksum``), and a multi-rank checkpoint also the
xxh3-64 of every ``block_size`` bytes of each shard file (its ``blocks``: a rank that reads a
range verifies only the blocks it reads). A kept snapshot's record holds the same values. This
module owns how they are computed, for every side that computes them: the uploaders as they
write, the keeper and the peer copies as a snapshot lands, the readers as they verify:

* ``checksum(data)``: of bytes held whole;
* ``hasher(initial)``: a streaming hasher, for a reader that hashes chunks as they arrive;
* ``FileHasher``: one file's checksum and, with a ``block_size``, its block checksums, in one
  pass over the bytes fed in order (a header, then the data);
* ``file_checksums(header, data, block_size)``: the same of bytes held whole;
* ``file_digest(path)``: the size and checksum of a local file, read in chunks.

Nothing here imports torch (the uploader processes never load it). Updates go in chunks of
``CHUNK`` at most: xxhash releases the GIL for each call, and a bounded call lets other threads in.
"""

from __future__ import annotations

from typing import Any

import xxhash

CHUNK = 16 << 20


def checksum(data: bytes | memoryview) -> str:
    """The xxh3-64 of ``data``, as the manifest lists it (hex)."""
    return xxhash.xxh3_64(data).hexdigest()


def hasher(initial: bytes | memoryview = b"") -> Any:
    """A streaming xxh3-64 (``update``, ``hexdigest``), started with ``initial``."""
    return xxhash.xxh3_64(initial)


class FileHasher:
    """The xxh3-64 of one file (its header, then its data fed in order), and of every
    ``block_size`` bytes of it when ``block_size`` (the last block may be shorter; an empty file
    has none)."""

    def __init__(self, header: bytes | memoryview, block_size: int) -> None:
        self.whole = xxhash.xxh3_64()
        self.block_size = block_size
        self.blocks: list[str] = []
        self.block, self.filled = xxhash.xxh3_64(), 0
        self.update(memoryview(header))

    def update(self, data: memoryview) -> None:
        data = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        if not self.block_size:
            for pos in range(0, len(data), CHUNK):
                self.whole.update(data[pos:pos + CHUNK])
            return
        pos = 0
        while pos < len(data):
            take = min(self.block_size - self.filled, len(data) - pos, CHUNK)
            piece = data[pos:pos + take]
            self.whole.update(piece)
            self.block.update(piece)
            self.filled, pos = self.filled + take, pos + take
            if self.filled == self.block_size:
                self.blocks.append(self.block.hexdigest())
                self.block, self.filled = xxhash.xxh3_64(), 0

    def result(self) -> tuple[str, tuple[str, ...]]:
        """The file's checksum and its block checksums (empty without a ``block_size``)."""
        blocks = [*self.blocks, self.block.hexdigest()] if self.filled else self.blocks
        return self.whole.hexdigest(), tuple(blocks)


def file_checksums(header: bytes | memoryview, data: memoryview, block_size: int) -> tuple[str, tuple[str, ...]]:
    """The checksum of ``header + data``, and of every ``block_size`` bytes of it when ``block_size``."""
    file = FileHasher(header, block_size)
    file.update(data)
    return file.result()


def file_digest(path: str) -> tuple[int, str]:
    """Size and xxh3-64 checksum of a local file, read in chunks (never whole)."""
    digest = xxhash.xxh3_64()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()
