"""A single process's kept record is published pending and completed after ``save()`` returns:
with the checksums the uploads of its slab computed, hashing only the shard files no upload
wrote, and never while the uploads are still running (the slab is not read twice beside the
training steps). Real shared memory: an arena's slab and the record in /dev/shm."""

from __future__ import annotations

import concurrent.futures
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from mpckpt._keep.keeper import Keeper
from mpckpt._keep.store import read_kept
from mpckpt._stage import written
from mpckpt._stage.arena import Arena
from mpckpt.format.checksums import file_checksums

MiB = 1 << 20
BOUND_S = 30.0  # an upper bound for things that must happen; never what a test measures


@dataclass(frozen=True)
class Shard:  # what ``Keeper.keep`` reads of a layout's ``ShardPlan``
    filename: str
    header: bytes
    offset: int
    nbytes: int


@pytest.fixture
def kept() -> Iterator[tuple[Keeper, Arena, str]]:
    url = f"file:///tmp/mpckpt-test-completion-{uuid.uuid4().hex}"
    arena = Arena(16 * MiB)
    keeper = Keeper(url, arena, enabled=True)
    try:
        yield keeper, arena, url
    finally:
        keeper.close(leave=False)
        arena.close()


def _keep(keeper: Keeper, arena: Arena, uploaded: concurrent.futures.Future | None) -> list[Shard]:
    slab = arena.try_acquire(4 * MiB)
    assert slab is not None
    written.allocate(slab)
    shards = [Shard(f"shard-{i}.safetensors", b'{"w":{"dtype":"U8"}}' + bytes([i]), i * MiB, MiB - 7 * i)
              for i in range(3)]
    for i, s in enumerate(shards):
        slab.segment.mmap[s.offset:s.offset + s.nbytes] = bytes([i + 1]) * s.nbytes
    keeper.keep(step=5, seq=0, metrics={}, shards=shards, slab=slab, small_name="skeleton.json",
                small=lambda blocks: b"{}", pending=True, uploaded=uploaded)
    return shards


def _real(shard: Shard, i: int) -> str:
    return file_checksums(shard.header, memoryview(bytes([i + 1]) * shard.nbytes), 0)[0]


def test_the_uploads_checksums_complete_the_record_and_only_the_rest_is_hashed(kept) -> None:
    keeper, arena, url = kept
    uploaded: concurrent.futures.Future[dict[str, str]] = concurrent.futures.Future()
    shards = _keep(keeper, arena, uploaded)
    record = keeper.kept[1]
    assert record.pending  # published before any checksum
    keeper.wait(0.5)  # nothing is hashed while the uploads run
    assert keeper.kept[1] is record and record.pending
    # two files written by the uploads (their checksums as given: taken, not computed again);
    # the third was not uploaded (reused, or its upload failed): hashed from the slab
    given = {shards[0].filename: "00000000000000aa", shards[2].filename: "00000000000000cc"}
    uploaded.set_result(given)
    keeper.wait(BOUND_S)
    done = keeper.kept[1]
    assert not done.pending
    assert {rel: span.checksum for rel, span in done.spans.items()} == {
        shards[0].filename: "00000000000000aa", shards[1].filename: _real(shards[1], 1),
        shards[2].filename: "00000000000000cc"}
    [found] = read_kept(url, 0, 1)  # what a restart finds
    try:
        assert found.record.spans == done.spans
    finally:
        found.close()


def test_without_uploads_every_file_is_hashed(kept) -> None:
    keeper, arena, _ = kept
    shards = _keep(keeper, arena, None)  # a mode="memory" save: nothing is uploaded
    keeper.wait(BOUND_S)
    done = keeper.kept[1]
    assert not done.pending
    assert [done.spans[s.filename].checksum for s in shards] == [_real(s, i) for i, s in enumerate(shards)]


def test_a_completion_that_cannot_start_leaves_the_record_pending(kept) -> None:
    """Uploads that end after the keeper closed (leaving its snapshot): the record stays pending,
    as after a kill; a restart computes the checksums from the slab."""
    keeper, arena, _ = kept
    uploaded: concurrent.futures.Future[dict[str, str]] = concurrent.futures.Future()
    _keep(keeper, arena, uploaded)
    keeper.completer.shutdown(wait=True)  # (what close() does first)
    uploaded.set_result({})
    keeper.wait(BOUND_S)  # returns: the completion is over, never started
    assert keeper.kept[1].pending
