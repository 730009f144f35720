"""Two ranks' keepers over a real store (torch.distributed.TCPStore on 127.0.0.1), real arenas
and /dev/shm: a rank holds its newest snapshot and the newest step every rank keeps, lets the
older go once a newer step is kept by every rank, and when its budget cannot hold both, the
save that needs the memory takes the oldest with a warning (never more than the budget)."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from mpckpt._keep.agreement import JobAgreement
from mpckpt._keep.keeper import Keeper
from mpckpt._keep.store import base_name, read_kept, record_names
from mpckpt._stage import written
from mpckpt._stage.arena import Arena
from tests.unit.test_keeper_completion import BOUND_S, MiB, Shard
from tests.waiting import poll_until


@pytest.fixture
def store() -> Iterator[dist.TCPStore]:
    server = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    yield dist.PrefixStore(f"t-{uuid.uuid4().hex}/", server)


def _ranks(store: dist.Store, budget_mib: int) -> tuple[str, list[Keeper], list[Arena]]:
    url = f"file:///tmp/mpckpt-test-keep-job-{uuid.uuid4().hex}"
    arenas = [Arena(budget_mib * MiB) for _ in range(2)]
    keepers = [Keeper(url, arenas[r], enabled=True, rank=r, world_size=2) for r in range(2)]
    for r, k in enumerate(keepers):
        k.join(JobAgreement(store, rank=r, world_size=2))
    return url, keepers, arenas


def _keep(keeper: Keeper, arena: Arena, step: int) -> None:
    slab = arena.acquire(4 * MiB, timeout_s=BOUND_S)
    written.allocate(slab)
    shard = Shard("shard-0.safetensors", b'{"w":{"dtype":"U8"}}', 0, MiB)
    slab.segment.mmap[0:MiB] = bytes([step % 251]) * MiB
    keeper.keep(step=step, seq=step, metrics={}, shards=[shard], slab=slab, small_name="rank-0.json",
                small=lambda blocks: b"{}", block_size=256 << 10)
    arena.release(slab)  # (its uploads done)


def _settled(keeper: Keeper, want: list[int]) -> list[int]:
    """The steps ``keeper`` holds once they are ``want`` (or the bound has passed: the test says what)."""
    def held() -> bool:
        keeper.wait(0.05)  # (its newest record's completion)
        return keeper.held_steps() == want

    poll_until(held, BOUND_S, poll_s=0.02)
    return keeper.held_steps()


def _close(keepers: list[Keeper], arenas: list[Arena]) -> None:
    for k, a in zip(keepers, arenas, strict=True):
        k.close(leave=False)
        a.close()


def test_a_rank_ahead_holds_the_step_every_rank_kept_until_a_newer_one_is(store):
    url, keepers, arenas = _ranks(store, 64)
    a, b = keepers
    try:
        _keep(b, arenas[1], 0)
        _keep(a, arenas[0], 0)
        _keep(b, arenas[1], 1)  # b a step ahead: 0 is kept by both, 1 only by b
        assert _settled(b, [0, 1]) == [0, 1]
        assert _settled(a, [0]) == [0]
        # what a restart finds on this node: each rank's records, the common step 0 among them
        assert [f.record.step for f in read_kept(url, 1, 2)] == [0, 1]
        _keep(a, arenas[0], 1)  # now 1 is kept by both
        assert _settled(a, [1]) == [1]
        _keep(b, arenas[1], 2)  # b learns 1 is agreed at its next keep: 0 goes
        assert _settled(b, [1, 2]) == [1, 2]
        assert record_names(base_name(url, 1)) == [f"{base_name(url, 1)}.{s}.record" for s in (1, 2)]
    finally:
        _close(keepers, arenas)


def test_a_budget_without_room_for_both_gives_up_the_oldest_with_a_warning(store, caplog):
    url, keepers, arenas = _ranks(store, 8)  # two 4 MiB slabs per rank: the next save's and one kept
    a, b = keepers
    caplog.set_level(logging.WARNING, logger="mpckpt")
    try:
        _keep(b, arenas[1], 0)
        _keep(b, arenas[1], 1)  # neither kept by rank 0 yet: both held, the budget is full
        assert _settled(b, [0, 1]) == [0, 1]
        _keep(b, arenas[1], 2)  # needs a slab: step 0's gives way
        assert b.held_steps() in ([1, 2], [2])
        assert 0 not in [f.record.step for f in read_kept(url, 1, 2)]
        assert "no room to keep the step every rank holds" in caplog.text
        assert arenas[1].allocated_bytes <= 8 * MiB
        _keep(a, arenas[0], 2)
        _keep(a, arenas[0], 3)
        assert _settled(a, [2, 3]) in ([2, 3], [3])
    finally:
        _close(keepers, arenas)
