"""The checksums of a kept snapshot's shard files, and completing a record published before them.

Every shard file of a kept snapshot has the xxh3-64 of its header followed by its data (the
manifest's checksum of that file: the very value storage gets), and in a multi-rank save the
xxh3-64 of every block of it. ``SpanHasher`` takes a file's bytes as they come (a copy that
hashes as it lands feeds it), ``hash_span`` hashes one file held whole.

A single process's eager save publishes its record before the checksums (``Keeper.keep``,
``pending``) and completes it afterwards (``with_checksums``: those its uploads computed, the rest
hashed here); a record its process left pending is completed with those the restore computed
(``Keeper.settle``).
"""

from __future__ import annotations

import dataclasses

import xxhash

from mpckpt._keep.record import KeptRecord

HASH_CHUNK = 16 << 20


class SpanHasher:
    """The xxh3-64 of one shard file (header, then its data fed in order), and of every
    ``block_size`` bytes of it when ``block_size`` (a multi-rank save's block checksums)."""

    def __init__(self, header: bytes, block_size: int) -> None:
        self.whole = xxhash.xxh3_64()
        self.block_size = block_size
        self.blocks: list[str] = []
        self.block, self.filled = xxhash.xxh3_64(), 0
        self.update(memoryview(header))

    def update(self, data: memoryview) -> None:
        if not self.block_size:
            for pos in range(0, len(data), HASH_CHUNK):
                self.whole.update(data[pos:pos + HASH_CHUNK])
            return
        pos = 0
        while pos < len(data):
            take = min(self.block_size - self.filled, len(data) - pos)
            piece = data[pos:pos + take]
            self.whole.update(piece)
            self.block.update(piece)
            self.filled, pos = self.filled + take, pos + take
            if self.filled == self.block_size:
                self.blocks.append(self.block.hexdigest())
                self.block, self.filled = xxhash.xxh3_64(), 0

    def result(self) -> tuple[str, tuple[str, ...]]:
        blocks = [*self.blocks, self.block.hexdigest()] if self.filled else self.blocks
        return self.whole.hexdigest(), tuple(blocks)


def hash_span(header: bytes, data: memoryview, block_size: int) -> tuple[str, tuple[str, ...]]:
    """xxh3-64 of ``header + data``, and of every ``block_size`` bytes of it when ``block_size``."""
    hasher = SpanHasher(header, block_size)
    hasher.update(data)
    return hasher.result()


def with_checksums(record: KeptRecord, digests: dict[str, str]) -> KeptRecord:
    """``record`` with the checksum of each of its shard files in ``digests`` (by relpath) filled in."""
    spans = {rel: dataclasses.replace(span, checksum=digests[rel]) if rel in digests else span
             for rel, span in record.spans.items()}
    return dataclasses.replace(record, spans=spans)
