"""The arena on its own, with real shared memory: slabs under one byte budget.

Covered: the bytes of all slabs (``allocated_bytes``, and the segments of this process in
/dev/shm) never exceed the budget over a long random sequence of acquires and releases; a
released slab big enough is reused (the smallest that fits); ``try_acquire`` returns None
when full; ``acquire`` waits boundedly, raising ``WaitTimeoutError``, or returns once another
thread releases; a request larger than the budget is a ``BudgetError``; ``ensure_spare``
makes one spare within the budget; ``reserve``; ``close`` unlinks every slab, in use or not.
Every arena is closed by the fixture, so a failing test leaks no segment.
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from mpckpt._stage.arena import Arena, Slab
from mpckpt._system import shm as _shm
from mpckpt.errors import BudgetError, WaitTimeoutError

MiB = 1 << 20
BOUND_S = 30.0  # an upper bound for things that must happen; never what a test measures


@pytest.fixture
def make_arena() -> Iterator[Callable[[int], Arena]]:
    arenas: list[Arena] = []

    def make(budget_bytes: int) -> Arena:
        arenas.append(Arena(budget_bytes))
        return arenas[-1]

    yield make
    for arena in arenas:
        arena.close()


@pytest.fixture
def shm_sizes() -> Callable[[], dict[str, int]]:
    """Name -> size of each segment this process made during the test, read in /dev/shm."""
    before = set(_shm.segments_of_this_process())

    def sizes() -> dict[str, int]:
        found = {}
        for name in set(_shm.segments_of_this_process()) - before:
            try:
                found[name] = os.stat(os.path.join(_shm.SHM_DIR, name)).st_size
            except FileNotFoundError:
                pass
        return found

    return sizes


def within(fn: Callable[[], Any], bound_s: float = BOUND_S) -> Any:
    """``fn()`` on a thread, which must end within ``bound_s``; its result, or what it raised."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:
            out["value"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(bound_s)
    assert not thread.is_alive(), f"still blocked after {bound_s}s"
    return out["value"]


def test_slabs_never_exceed_the_budget(make_arena, shm_sizes):
    budget = 16 * MiB
    arena = make_arena(budget)
    rng = random.Random(1234)
    held: list[Slab] = []
    for _ in range(300):
        if held and (rng.random() < 0.45 or len(held) > 6):
            arena.release(held.pop(rng.randrange(len(held))))
        else:
            nbytes = rng.randint(1, 9 * MiB)
            slab = arena.try_acquire(nbytes)
            if slab is not None:
                assert slab.capacity >= nbytes and slab not in held
                held.append(slab)
        sizes = shm_sizes()
        assert arena.allocated_bytes <= budget
        assert sum(sizes.values()) == arena.allocated_bytes
        assert sum(s.capacity for s in held) <= budget
        assert {s.name for s in held} <= set(sizes)
    assert 0 < arena.peak_bytes <= budget


def test_a_released_slab_big_enough_is_reused(make_arena, shm_sizes):
    arena = make_arena(16 * MiB)
    small, big = arena.try_acquire(1 * MiB), arena.try_acquire(3 * MiB)
    assert small is not None and big is not None
    assert (small.capacity, big.capacity) == (2 * MiB, 4 * MiB)  # 2 MiB steps
    big.tensor[:4] = 7
    arena.release(small)
    arena.release(big)
    names = set(shm_sizes())

    assert arena.try_acquire(1) is small  # the smallest free slab that fits
    again = arena.try_acquire(3 * MiB)
    assert again is big and int(again.tensor[0]) == 7  # the same mapping, not a new segment
    assert set(shm_sizes()) == names and arena.allocated_bytes == 6 * MiB


def test_try_acquire_returns_none_when_the_budget_is_full(make_arena, shm_sizes):
    arena = make_arena(4 * MiB)
    held = [arena.try_acquire(2 * MiB), arena.try_acquire(1)]
    assert all(s is not None for s in held)
    names = set(shm_sizes())
    assert arena.try_acquire(1) is None
    assert set(shm_sizes()) == names  # nothing made, nothing dropped
    arena.release(held[0])
    assert arena.try_acquire(1) is held[0]


def test_a_free_slab_too_small_is_unlinked_to_make_room(make_arena, shm_sizes):
    arena = make_arena(8 * MiB)
    small = arena.try_acquire(2 * MiB)
    assert small is not None
    arena.release(small)
    big = arena.try_acquire(8 * MiB)
    assert big is not None and big.capacity == 8 * MiB
    assert list(shm_sizes().values()) == [8 * MiB] and arena.allocated_bytes == 8 * MiB


def test_acquire_times_out_when_nothing_is_released(make_arena, shm_sizes):
    arena = make_arena(2 * MiB)
    assert arena.try_acquire(2 * MiB) is not None
    waits: list[None] = []
    error = within(lambda: arena.acquire(1, timeout_s=0.3, on_wait=lambda: waits.append(None)))
    assert isinstance(error, WaitTimeoutError)
    assert "memory budget" in str(error) and str(2 * MiB) in str(error)
    assert waits  # the caller's hook ran while it waited (to raise background errors)
    assert arena.allocated_bytes == 2 * MiB


def test_acquire_returns_once_another_thread_releases(make_arena, shm_sizes):
    arena = make_arena(4 * MiB)
    held = arena.try_acquire(4 * MiB)
    assert held is not None
    waiting = threading.Event()
    got: dict[str, Any] = {}

    def waiter() -> None:
        got["slab"] = arena.acquire(3 * MiB, timeout_s=BOUND_S, on_wait=waiting.set)

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    try:
        assert waiting.wait(BOUND_S)  # it found the budget full and is waiting
        assert "slab" not in got
        arena.release(held)
    finally:
        thread.join(BOUND_S)
    assert not thread.is_alive()
    assert got["slab"] is held  # the released slab, not a new one
    assert arena.allocated_bytes == 4 * MiB


def test_a_request_larger_than_the_budget_is_a_budget_error(make_arena, shm_sizes):
    arena = make_arena(3 * MiB)
    with pytest.raises(BudgetError, match="larger than the memory budget"):
        arena.try_acquire(3 * MiB + 1)
    error = within(lambda: arena.acquire(8 * MiB, timeout_s=BOUND_S))
    assert isinstance(error, BudgetError)  # at once: waiting could never help
    assert arena.reserve(8 * MiB) == 1  # reserve clamps to the budget
    slab = arena.try_acquire(3 * MiB)  # exactly the budget fits, though not a 2 MiB step
    assert slab is not None and slab.capacity == 3 * MiB
    assert shm_sizes() == {slab.name: 3 * MiB}


def test_ensure_spare_makes_one_free_slab_within_the_budget(make_arena, shm_sizes):
    arena = make_arena(4 * MiB)
    first = arena.try_acquire(2 * MiB)
    assert first is not None
    arena.ensure_spare(2 * MiB)
    arena.ensure_spare(2 * MiB)  # asking again makes no second one
    assert arena.allocated_bytes == 4 * MiB  # counted against the budget while it is being made
    spare = within(lambda: arena.try_acquire(2 * MiB))  # the budget is full: it waits for the spare
    assert isinstance(spare, Slab) and spare is not first
    assert arena.allocated_bytes == 4 * MiB
    assert sorted(shm_sizes().values()) == [2 * MiB, 2 * MiB]


def test_ensure_spare_makes_nothing_without_room_or_need(make_arena, shm_sizes):
    arena = make_arena(4 * MiB)
    held = [arena.try_acquire(2 * MiB), arena.try_acquire(2 * MiB)]
    assert all(s is not None for s in held)
    names = set(shm_sizes())
    arena.ensure_spare(2 * MiB)  # no room
    arena.ensure_spare(5 * MiB)  # larger than the budget
    arena.release(held[0])  # type: ignore[arg-type]
    arena.ensure_spare(2 * MiB)  # a free slab fits already
    # a spare counts in allocated_bytes from the moment ensure_spare decides to make it
    assert arena.allocated_bytes == 4 * MiB and arena.peak_bytes == 4 * MiB
    assert set(shm_sizes()) == names


def test_close_waits_for_a_spare_being_made_and_unlinks_it(make_arena, shm_sizes):
    arena = make_arena(8 * MiB)
    slab = arena.try_acquire(4 * MiB)
    assert slab is not None
    arena.ensure_spare(4 * MiB)
    arena.close()
    assert shm_sizes() == {} and arena.allocated_bytes == 0


def test_reserve_makes_free_slabs_as_the_budget_allows(make_arena, shm_sizes):
    arena = make_arena(8 * MiB)
    assert arena.reserve(3 * MiB, count=5) == 2  # two 4 MiB slabs fit
    assert arena.allocated_bytes == 8 * MiB
    names = set(shm_sizes())
    taken = [arena.try_acquire(3 * MiB), arena.try_acquire(3 * MiB)]
    assert all(s is not None for s in taken) and {s.name for s in taken} == names  # type: ignore[union-attr]
    assert arena.try_acquire(1) is None
    assert arena.reserve(1 * MiB) == 0  # nothing free and no room


def test_close_unlinks_every_slab_also_those_in_use(make_arena, shm_sizes):
    arena = make_arena(16 * MiB)
    in_use = arena.try_acquire(4 * MiB)
    free = arena.try_acquire(2 * MiB)
    assert in_use is not None and free is not None
    arena.release(free)
    assert len(shm_sizes()) == 2
    arena.close()
    assert shm_sizes() == {} and arena.allocated_bytes == 0
    arena.release(in_use)  # the uploads finishing after close: harmless
    arena.close()  # and closing twice too
    assert shm_sizes() == {}


def test_nothing_is_made_after_close(make_arena, shm_sizes):
    arena = make_arena(8 << 20)
    arena.close()
    for request in (lambda: arena.try_acquire(1 << 20), lambda: arena.acquire(1 << 20, timeout_s=1),
                    lambda: arena.reserve(1 << 20)):
        with pytest.raises(BudgetError, match="closed"):
            request()
    assert shm_sizes() == {}


def test_dev_shm_running_out_is_a_budget_error_not_a_sigbus(make_arena, monkeypatch):
    """A slab made ahead is allocated when made, one made in a save before anything is written
    through its map: /dev/shm running out fails there, cleanly, and the slab stays sparse."""
    from mpckpt._stage import written

    arena = make_arena(64 * MiB)
    before = set(_shm.segments_of_this_process())

    def full(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_shm.os, "posix_fallocate", full)
    monkeypatch.setattr(written.os, "posix_fallocate", full)
    assert arena.reserve(8 * MiB, count=2) == 0  # warming (prepare, restore) is best effort: no raise
    assert set(_shm.segments_of_this_process()) == before  # the failed segment is unlinked
    assert arena.allocated_bytes == 0
    slab = arena.try_acquire(8 * MiB)  # made inside a save: no page yet
    assert slab is not None and slab.sparse
    with pytest.raises(BudgetError, match=r"no room in /dev/shm for 8 MiB.*--shm-size"):
        written.allocate(slab)
    assert slab.sparse  # still never written through its map
    monkeypatch.undo()
    written.allocate(slab)  # room again: the arena works on
    assert not slab.sparse and os.stat(f"/dev/shm/{slab.name}").st_blocks * 512 >= slab.capacity


def test_slabs_made_ahead_are_touched_and_every_page_is_allocated(make_arena):
    from mpckpt._stage import written

    arena = make_arena(64 * MiB)
    assert arena.reserve(8 * MiB) == 1
    ahead = arena.try_acquire(8 * MiB)
    assert ahead is not None and not ahead.sparse
    in_save = arena.try_acquire(8 * MiB)  # made inside a save: sparse, allocated as it is written
    assert in_save is not None and in_save.sparse
    assert os.stat(f"/dev/shm/{in_save.name}").st_blocks == 0
    written.allocate(in_save)
    for slab in (ahead, in_save):
        st = os.stat(f"/dev/shm/{slab.name}")
        assert st.st_blocks * 512 >= slab.capacity  # no hole a write could SIGBUS on
    assert bool((in_save.tensor == 0).all())  # fresh pages read as zeros either way


def _mapped_bytes(slab: Slab) -> int:
    """The bytes of ``slab``'s map that are mapped into this process now (its Rss in smaps)."""
    import ctypes

    view = memoryview(slab.segment.mmap)
    try:
        address = ctypes.addressof(ctypes.c_char.from_buffer(view))
    finally:
        view.release()
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no map of {slab.name} in /proc/self/smaps")


def test_a_slab_written_through_its_file_is_mapped_whole_in_the_background(make_arena):
    """``populate`` maps every page of a slab filled through its file, the last partial piece
    too (it maps in pieces, so that the process's map lock is never held for the whole slab)."""
    import ctypes
    import mmap

    from mpckpt._stage import written

    probe = mmap.mmap(-1, 4096)
    view = ctypes.c_char.from_buffer(probe)
    try:  # MADV_POPULATE_WRITE came with Linux 5.14; before it populate maps nothing (best effort)
        if ctypes.CDLL(None).madvise(ctypes.c_void_p(ctypes.addressof(view)), ctypes.c_size_t(4096),
                                     written._MADV_POPULATE_WRITE) != 0:
            pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    finally:
        del view
        probe.close()
    arena = make_arena(64 * MiB)
    slab = arena.try_acquire(written._POPULATE_CHUNK * 2 + 3 * 4096)
    assert slab is not None and slab.sparse
    written.allocate(slab)  # every page exists in /dev/shm; none is mapped here yet
    assert _mapped_bytes(slab) < slab.capacity
    thread = written.populate(slab)
    thread.join(BOUND_S)
    assert not thread.is_alive()
    assert _mapped_bytes(slab) >= slab.capacity


def test_a_peer_copy_is_held_beside_two_own_slabs_and_a_spare_gives_way_to_it(make_arena, shm_sizes):
    arena = make_arena(12 * MiB)
    slabs = [arena.try_acquire(4 * MiB) for _ in range(3)]  # the kept one, the next save's, a spare
    assert all(s is not None for s in slabs)
    arena.keep(slabs[0])
    for slab in slabs:
        arena.release(slab)
    assert arena.hold_external(4 * MiB)  # the spare is unlinked for it
    assert len(shm_sizes()) == 2 and arena.allocated_bytes == 12 * MiB
    assert not arena.hold_external(1)  # two own slabs stay: no more room
    arena.release_external(4 * MiB)
    assert arena.allocated_bytes == 8 * MiB


def test_a_peer_copy_leaves_room_for_the_next_save_of_a_checkpointer_with_one_slab(make_arena, shm_sizes):
    arena = make_arena(12 * MiB)
    kept = arena.try_acquire(4 * MiB)
    assert kept is not None
    arena.keep(kept)
    arena.release(kept)
    assert not arena.hold_external(6 * MiB)  # 4 kept + 4 for the next save + 6 > 12
    assert arena.hold_external(4 * MiB)
    assert arena.try_acquire(4 * MiB) is not None  # the next save still finds its slab
