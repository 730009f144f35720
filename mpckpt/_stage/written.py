"""Filling a slab through its file (``pwritev``) instead of its map, and making its pages exist.

A slab a save has to make itself (the first save of a run that never called ``prepare`` or
``restore``) is created sparse (``Slab.sparse``). ``posix_fallocate`` and then a copy through the
map touch every page twice (the kernel zeroes it, then the copy faults it into the map); writing
the state into the file allocates each page as it fills it, in one pass, and a full /dev/shm is
ENOSPC from the write (a ``BudgetError``), never a SIGBUS from a write into a hole of the map.
On this project's 2-core VM, for 1 GiB: fallocate + copy through the map 5.8 s, a copy through a
lazily faulted map 2.6 s, ``pwrite`` 0.88 s, a copy into touched memory 0.84 s (one run, other
processes on both cores: the ratios, not the seconds).

INVARIANT: nothing writes a sparse slab through its map. A save fills it through the file
(``write_wave``: every piece, then the pages no piece covers are allocated) or allocates it whole
first (``allocate``); both leave it dense. A failure leaves it sparse.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import os
import threading
from collections.abc import Callable
from typing import Any

from mpckpt._stage.arena import Slab
from mpckpt._stage.layout import Layout
from mpckpt._system.shm import SHM_DIR
from mpckpt._threads import Thread
from mpckpt.errors import BudgetError

_MADV_POPULATE_WRITE = 23  # linux/mman.h (5.14): map a range's pages as a write would, without writing
_PAGE = 4096
_POPULATE_CHUNK = 8 << 20  # mapped per call: the process's map lock is held for one piece at a time
_CHUNK = 4 << 20  # written, then fed on while still in the cache
_IOV_MAX = 1024


def _open(slab: Slab) -> int:
    return os.open(os.path.join(SHM_DIR, slab.name), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)


def _full(e: OSError, slab: Slab) -> BudgetError:
    return BudgetError(f"no room in /dev/shm for {slab.capacity >> 20} MiB of the memory budget ({e.strerror}); "
                       "free space there (docker: --shm-size) or lower memory_budget / MPCKPT_MEMORY_BUDGET")


def allocate(slab: Slab) -> None:
    """Allocate every page of a sparse ``slab`` (before it is written through its map)."""
    if not slab.sparse:
        return
    fd = _open(slab)
    try:
        os.posix_fallocate(fd, 0, slab.capacity)
    except OSError as e:
        raise _full(e, slab) from e
    finally:
        os.close(fd)
    slab.sparse = False


def populate(slab: Slab) -> threading.Thread:
    """Map the pages of a slab filled through its file into this process, in the background (the
    thread returned), so that a later save copying through the map pays no page faults (best
    effort). In pieces of ``_POPULATE_CHUNK``: mapping pages holds this process's map lock, and
    any thread that allocates memory meanwhile (a new arena of Python objects is a map) waits for
    it. Mapped whole in one call, the rest of a first save of 5,424 tensors spent ~230 ms in a
    5 ms list comprehension, waiting for 1 GiB to be mapped."""
    thread = Thread(target=_map_pages, args=(slab,), name="mpckpt-map-slab", daemon=True)
    thread.start()
    return thread


def _map_pages(slab: Slab) -> None:
    try:
        view = memoryview(slab.segment.mmap)  # INVARIANT: held, the map cannot go away meanwhile
    except ValueError:  # closed already
        return
    try:
        address = ctypes.addressof(ctypes.c_char.from_buffer(view))
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        for at in range(0, len(view), _POPULATE_CHUNK):  # (ctypes calls leave the GIL)
            madvise(ctypes.c_void_p(address + at), ctypes.c_size_t(min(_POPULATE_CHUNK, len(view) - at)),
                    _MADV_POPULATE_WRITE)
    finally:
        view.release()


def write_wave(flat: Any, layout: Layout, wave_index: int, slab: Slab, *,
               feed: Callable[[int, memoryview], None] | None = None,
               pool: concurrent.futures.Executor | None = None) -> bool:
    """Write every piece of wave ``wave_index`` of ``flat`` into ``slab``'s file at its offset,
    shard by shard (on ``pool``'s threads when given), handing each shard's bytes to ``feed(shard
    index, bytes)`` in file order (read from the sources, which hold the same bytes); then allocate
    the pages no piece covers. False, nothing written, when a source is not contiguous CPU memory
    (copy it through the map then, after ``allocate``)."""
    wave = layout.waves[wave_index]
    sources = flat.sources
    if flat.on_cuda or any(not sources[p.leaf].is_contiguous() for s in wave.shards for p in s.pieces):
        return False
    fd = _open(slab)
    try:
        def one_shard(index: int) -> None:
            _write_shard(fd, wave.shards[index].pieces, sources, None if feed is None else lambda v: feed(index, v))

        shards = range(len(wave.shards))
        try:
            if pool is None:
                for index in shards:
                    one_shard(index)
            else:
                for done in [pool.submit(one_shard, index) for index in shards]:
                    done.result()
            for start, end in _holes([(s.offset, s.offset + s.nbytes) for s in wave.shards], slab.capacity):
                os.posix_fallocate(fd, start, end - start)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.ENOMEM, errno.EDQUOT):
                raise _full(e, slab) from e
            raise
    finally:
        os.close(fd)
    slab.sparse = False
    return True


def _write_shard(fd: int, pieces: list[Any], sources: list[Any], feed: Callable[[memoryview], None] | None) -> None:
    """The pieces of one shard (they tile its range in order), in writes of about ``_CHUNK``."""
    batch: list[memoryview] = []
    at = start = pieces[0].offset if pieces else 0
    for p in pieces:
        if not p.nbytes:
            continue
        src = sources[p.leaf].data_ptr() + (p.chunk[0] * p.itemsize if p.chunk else 0)
        whole = memoryview((ctypes.c_ubyte * p.nbytes).from_address(src)).cast("B")
        for pos in range(0, p.nbytes, _CHUNK):
            batch.append(whole[pos:pos + _CHUNK])
            at += len(batch[-1])
            if at - start >= _CHUNK or len(batch) == _IOV_MAX:
                _flush(fd, batch, start, feed)
                batch, start = [], at
    _flush(fd, batch, start, feed)


def _flush(fd: int, batch: list[memoryview], offset: int, feed: Callable[[memoryview], None] | None) -> None:
    views = batch
    while views:
        n = os.pwritev(fd, views, offset)  # a short write only when space ran out: the next one says so
        offset += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views = views[1:]
        if views and n:
            views = [views[0][n:], *views[1:]]
    if feed is not None:
        for view in batch:
            feed(view)


def _holes(ranges: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """The whole pages of ``[0, size)`` that no range touches."""
    holes, at = [], 0
    for start, end in sorted(r for r in ranges if r[1] > r[0]):
        lo = start // _PAGE * _PAGE
        if lo > at:
            holes.append((at, lo))
        at = max(at, -(-end // _PAGE) * _PAGE)
    if at < size:
        holes.append((at, size))
    return holes
