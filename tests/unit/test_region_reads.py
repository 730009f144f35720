"""Block-verified reads of a multi-rank checkpoint's files (``_read.regions._Files.read_into``).

Whole blocks inside a range are read straight into the caller's buffer and hashed there; the
blocks at its ends are read whole, verified and cached. Every range shape is checked against
the file's bytes, and a damaged block, interior or at an end, must raise before the caller can
take the bytes as good.
"""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import pytest
import xxhash

from mpckpt._read.regions import _Files
from mpckpt.errors import CorruptCheckpointError

BLOCK = 16


class _BytesSource:
    """One file held in memory, as a ``_read.sources.Source`` serves it; counts its reads."""

    kind = "storage"
    name = "step_0000000001"

    def __init__(self, data: bytes) -> None:
        self.data = bytearray(data)
        self.manifest = SimpleNamespace(files={"f": SimpleNamespace(size=len(data))})
        self.reads: list[tuple[int, int]] = []

    def location(self, relpath: str) -> str:
        return f"root/{self.name}/{relpath}"

    def size(self, relpath: str) -> int:
        return len(self.data)

    def read_into(self, relpath: str, offset: int, out: memoryview) -> None:
        self.reads.append((offset, len(out)))
        out[:] = self.data[offset:offset + len(out)]


def _files(data: bytes) -> tuple[_Files, _BytesSource]:
    source = _BytesSource(data)
    files = _Files(source, [])  # type: ignore[arg-type]
    digests = [xxhash.xxh3_64(data[i:i + BLOCK]).hexdigest() for i in range(0, len(data), BLOCK)]
    files.blocks = {"f": (BLOCK, digests)}
    return files, source


@pytest.mark.parametrize("size", [5 * BLOCK, 5 * BLOCK + 7])  # the last block whole or short
def test_every_range_reads_the_files_bytes(size):
    data = random.Random(size).randbytes(size)
    points = sorted({0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK, 3 * BLOCK - 3, 4 * BLOCK, size - 1, size})
    for start, end in itertools.combinations_with_replacement(points, 2):
        files, _ = _files(data)
        out = bytearray(end - start)
        files.read_into("f", start, memoryview(out))
        assert bytes(out) == data[start:end], (start, end)


def test_whole_blocks_are_read_once_into_place_and_the_ends_go_through_the_cache():
    data = random.Random(1).randbytes(8 * BLOCK)
    files, source = _files(data)
    out = bytearray(6 * BLOCK)
    files.read_into("f", BLOCK // 2, memoryview(out))  # half a block, 5 whole ones, half a block
    assert bytes(out) == data[BLOCK // 2:BLOCK // 2 + 6 * BLOCK]
    assert sorted(source.reads) == [(0, BLOCK), (BLOCK, 5 * BLOCK), (6 * BLOCK, BLOCK)]
    source.reads.clear()
    neighbour = bytearray(BLOCK // 4)  # a small tensor beside it, in the last block: cached
    files.read_into("f", 6 * BLOCK + BLOCK // 2, memoryview(neighbour))
    assert bytes(neighbour) == data[6 * BLOCK + BLOCK // 2:6 * BLOCK + 3 * BLOCK // 4]
    assert source.reads == []


@pytest.mark.parametrize("damaged", [0, 3, 7])  # a block at the range's start, inside it, at its end
def test_a_damaged_block_raises_whatever_its_place(damaged):
    data = random.Random(2).randbytes(8 * BLOCK)
    files, source = _files(data)
    source.data[damaged * BLOCK + 2] ^= 0xFF
    out = bytearray(8 * BLOCK - 4)
    with pytest.raises(CorruptCheckpointError, match=rf"block {damaged} \(bytes {damaged * BLOCK}\+\) does not match"):
        files.read_into("f", 2, memoryview(out))


def test_a_range_past_the_files_end_is_refused():
    files, _ = _files(bytes(3 * BLOCK))
    with pytest.raises(CorruptCheckpointError, match="asked of a file of 48"):
        files.read_into("f", 2 * BLOCK, memoryview(bytearray(BLOCK + 1)))
