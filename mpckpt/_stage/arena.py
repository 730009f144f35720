"""Reusable shared-memory slabs and the one byte budget over all of them.

A slab is a named shared-memory segment whose pages are allocated before anything is written
through its map (``posix_fallocate``, or writes to its file: /dev/shm running out is a clear
``BudgetError`` then, never a SIGBUS later), viewed as a flat uint8 tensor. A save takes one free slab per wave, copies into it,
and gives it back once the uploaders have written that wave.

Slabs made ahead of a save (``reserve``: ``prepare``/``restore``; the spare below) are also
touched, so no page fault is paid inside ``save``. A slab a save has to make itself (the first
save of a run that never called ``prepare``) is not even allocated (``Slab.sparse``): the save
writes the state into its file, which allocates each page as it fills it (``written``), in one
pass instead of an allocation pass, a fault per page and the copy.

When a save takes the last free slab, ``ensure_spare`` creates and touches one more of the
same size in a background thread (budget permitting), so the next save, which usually comes
while this one is still uploading, finds a warm slab instead of paying for page faults. A
restore warms for the next saves the same way (``count=2``, one slab at a time), off its own
path. A save that finds no free slab while one it fits is being made waits for that one
rather than making another.

Copies of other nodes' snapshots held by this rank (``_peer``) live in files of their own and
are counted too (``hold_external``): a copy that does not fit is refused, never allocated.

INVARIANT: the bytes of all slabs that exist (or are being created), plus the copies held,
never exceed ``budget_bytes``. When a request
does not fit, free slabs that are too small are unlinked to make room; if the budget is
still full the caller's policy decides (``acquire`` waits with a timeout, ``try_acquire``
returns None at once). So the shared memory mpckpt uses — measured from the outside as the
size of its segments in /dev/shm — never exceeds the budget.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from mpckpt._system.shm import Segment
from mpckpt._threads import Thread
from mpckpt.errors import BudgetError, WaitTimeoutError

log = logging.getLogger("mpckpt")
_ROUND = 2 << 20  # slabs are sized in 2 MiB steps so similar requests reuse one
_TOUCH = 64 << 20  # a slab made ahead is touched in pieces this size, so close() need not wait for all


class Slab:
    """One segment and its uint8 tensor view; ``views`` caches typed views per layout."""

    def __init__(self, segment: Segment) -> None:
        self.segment = segment
        self.tensor = torch.frombuffer(segment.mmap, dtype=torch.uint8)
        self.views: dict[Any, list[torch.Tensor]] = {}
        self.in_use = False
        self.kept = False  # holds a complete snapshot kept in memory (``_keep``): not free
        self.pinned = False  # registered with CUDA (``pin``): device-to-host copies into it run at full speed
        self._pin_refused = False
        self.sparse = False  # pages not allocated yet: never written through the map (``written``)

    @property
    def name(self) -> str:
        return self.segment.name

    def pin(self) -> bool:
        """Page-lock the slab (once; a refusal is not retried); whether it is. Its pages must exist
        (not ``sparse``): registering maps every one."""
        if not self.pinned and not self._pin_refused:
            self.pinned = _pin(self.tensor)
            self._pin_refused = not self.pinned
        return self.pinned

    @property
    def capacity(self) -> int:
        return self.segment.size


class Arena:
    """All slabs of one checkpointer, bounded by one byte budget."""

    def __init__(self, budget_bytes: int, *, pin: bool = False) -> None:
        self.budget_bytes = budget_bytes
        self.pin = pin
        self._slabs: list[Slab] = []
        self._creating = 0  # bytes of a spare slab being made in the background
        self._external = 0  # bytes held outside the slabs: copies of other nodes' snapshots (``_peer``)
        self._cond = threading.Condition()
        self.peak_bytes = 0
        self.closed = False
        # called (holding this arena's lock) when a save needs a kept slab's memory, with the kept
        # slabs no upload holds; returns those given up (their records gone): the keeper
        # removes its record before the slab is written again
        self.reclaim: Callable[[list[Slab]], list[Slab]] | None = None
        self._spares: queue.SimpleQueue[tuple[int, int, int] | None] = queue.SimpleQueue()
        self._spare_maker = Thread(target=self._serve_spares, name="mpckpt-spare-slab", daemon=True)
        self._spare_maker.start()

    @property
    def allocated_bytes(self) -> int:
        return sum(s.capacity for s in self._slabs) + self._creating + self._external

    def hold_external(self, nbytes: int) -> bool:
        """Count ``nbytes`` of memory held outside the slabs (a peer copy) if the budget has room,
        beside the two slabs this checkpointer's own saves need (the kept one and the next save's):
        free slabs beyond those (a spare made ahead) give way to it."""
        with self._cond:
            largest = max((s.capacity for s in self._slabs), default=self._creating)
            made = len(self._slabs) + (1 if self._creating else 0)
            idle = sorted((s for s in self._slabs if not s.in_use and not s.kept), key=lambda s: s.capacity)
            while idle and made > 2 and self.allocated_bytes + nbytes > self.budget_bytes:
                self._drop(idle.pop(0))
                made -= 1
            own = max(0, 2 - made) * largest
            if self.closed or self.allocated_bytes + own + nbytes > self.budget_bytes:
                return False
            self._external += nbytes
            self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
            return True

    def release_external(self, nbytes: int) -> None:
        with self._cond:
            self._external = max(0, self._external - nbytes)
            self._cond.notify_all()

    def _fits(self, nbytes: int) -> Slab | None:
        free = [s for s in self._slabs if not s.in_use and not s.kept and s.capacity >= nbytes]
        return min(free, key=lambda s: s.capacity) if free else None

    def _take(self, nbytes: int, *, touch: bool = False) -> Slab | None:
        """A free slab of at least ``nbytes`` (reused, or made within the budget), or None.

        A slab made here is touched only with ``touch`` (made ahead of a save).
        """
        if self.closed:  # a waiter woken by close() must not make a segment nobody will unlink
            raise BudgetError("the checkpointer is closed; its shared memory is gone")
        slab = self._fits(nbytes)
        if slab is None:
            if self._creating >= nbytes:  # a spare being made will do: wait for it (the caller does)
                return None
            size = min(-(-nbytes // _ROUND) * _ROUND, self.budget_bytes)
            if size < nbytes:
                raise BudgetError(f"a wave of {nbytes} bytes is larger than the memory budget ({self.budget_bytes})")
            for idle in sorted((s for s in self._slabs if not s.in_use and not s.kept), key=lambda s: s.capacity):
                if self.allocated_bytes + size <= self.budget_bytes:
                    break
                self._drop(idle)
            if self.allocated_bytes + size > self.budget_bytes:
                kept = [s for s in self._slabs if s.kept and not s.in_use]
                if not kept or self._creating or self.reclaim is None:
                    return None
                given = self.reclaim(kept)  # nothing else is free: a kept snapshot gives way to the save
                for slab in given:
                    slab.kept = False
                if not any(s in kept for s in given):
                    return None
                return self._take(nbytes, touch=touch)
            slab = self._create(size, touch=touch)
        slab.in_use = True
        return slab

    def _create(self, size: int, *, touch: bool) -> Slab:
        slab = self._make(size, touch=touch)
        self._slabs.append(slab)
        self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
        return slab

    def _make(self, size: int, *, touch: bool) -> Slab:
        pin = self.pin and torch.cuda.is_available()
        try:  # made inside a save: sparse, filled through its file (``written``) or allocated first
            segment = Segment.create(size, allocate=touch or pin)
        except OSError as e:
            raise BudgetError(f"no room in /dev/shm for {size >> 20} MiB of the memory budget ({e.strerror}); "
                              "free space there (docker: --shm-size) or lower memory_budget / MPCKPT_MEMORY_BUDGET") from e
        slab = Slab(segment)
        slab.sparse = not (touch or pin)
        if touch:  # map every page now, not during a save
            for start in range(0, size, _TOUCH):
                if self.closed:  # a spare still being made at close(): it is dropped, stop mapping it
                    break
                slab.tensor[start:start + _TOUCH].zero_()
        if pin:
            slab.pin()
        return slab

    def ensure_spare(self, nbytes: int, *, count: int = 1) -> None:
        """Start making free slabs of ``nbytes`` in a background thread, one at a time, until
        ``count`` are free (at most ``count`` made), as the budget allows."""
        with self._cond:
            size = self._spare_size(nbytes, count)
            if size is None:
                return
            self._creating = size  # INVARIANT: counted in allocated_bytes until it exists or failed
            self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
        self._spares.put((nbytes, size, count))

    def _serve_spares(self) -> None:
        """The thread that makes spare slabs, started with the arena: asking it is a queue put, where
        starting a thread inside a save waited for the new thread to be scheduled (over 200 ms with
        the uploaders and the slab's page mapping on both cores, after a first save's copy)."""
        while (job := self._spares.get()) is not None:
            self._make_spares(*job)

    def _spare_size(self, nbytes: int, count: int) -> int | None:
        """The size of one more spare to make now (lock held); None when closed, when one is being
        made, when ``count`` are free, or when it does not fit the budget."""
        if self.closed or self._creating:
            return None
        free: list[Slab] = []  # counted as saves see them (``_fits``), by holding each for a moment
        while len(free) < count and (slab := self._fits(nbytes)) is not None:
            slab.in_use = True
            free.append(slab)
        for slab in free:
            slab.in_use = False
        size = min(-(-nbytes // _ROUND) * _ROUND, self.budget_bytes)
        if len(free) >= count or size < nbytes or self.allocated_bytes + size > self.budget_bytes:
            return None
        return size

    def _make_spares(self, nbytes: int, size: int, count: int) -> None:
        for made in range(1, count + 1):
            try:
                slab: Slab | None = self._make(size, touch=True)
            except (BudgetError, OSError, RuntimeError):
                slab = None  # no room in /dev/shm right now: a later save will wait or stream instead
            except BaseException as e:  # never leave _creating set: close() and waiting saves wait on it
                log.error("mpckpt: making a spare shared-memory slab failed: %s: %s", type(e).__name__, e, exc_info=e)
                slab = None
            with self._cond:
                self._creating = 0
                if slab is not None:
                    self._slabs.append(slab)
                    if self.closed:
                        self._drop(slab)
                self._cond.notify_all()
                size_next = self._spare_size(nbytes, count) if slab is not None and made < count else None
                if size_next is None:
                    return
                self._creating = size = size_next
                self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)

    def _drop(self, slab: Slab) -> None:
        self._slabs.remove(slab)
        if slab.pinned:
            _unpin(slab.tensor)
        slab.views.clear()
        del slab.tensor
        slab.segment.close()
        slab.segment.unlink()

    def reserve(self, nbytes: int, *, count: int = 1) -> int:
        """Have ``count`` free slabs of ``nbytes`` made and touched now, as the budget allows.

        Returns how many there are. Warming is best effort: with no room left in /dev/shm it
        stops there (logged), and the first save makes or waits for what it needs.
        """
        with self._cond:
            held = []
            for _ in range(count):
                while self._creating and not self.closed:  # a spare being made (ensure_spare) comes first
                    self._cond.wait(1.0)
                try:
                    slab = self._take(min(nbytes, self.budget_bytes), touch=True)
                except BudgetError as e:
                    if self.closed:
                        raise
                    log.warning("mpckpt: warming shared memory stopped: %s", e)
                    break
                if slab is None:
                    break
                held.append(slab)
            for slab in held:
                slab.in_use = False
            return len(held)

    def idle(self) -> list[Slab]:
        """The slabs no save holds and no kept snapshot holds, as they are now."""
        with self._cond:
            return [s for s in self._slabs if not s.in_use and not s.kept]

    def try_acquire(self, nbytes: int) -> Slab | None:
        """A slab now, or None if the budget is full (a spare being made is waited for)."""
        with self._cond:
            slab = self._take(nbytes)
            while slab is None and self._creating:
                self._cond.wait(1.0)
                slab = self._take(nbytes)
            return slab

    def acquire(self, nbytes: int, *, timeout_s: float, on_wait: Callable[[], None] | None = None) -> Slab:
        """A slab of at least ``nbytes``, waiting up to ``timeout_s`` for uploads to free one."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                slab = self._take(nbytes)
                if slab is not None:
                    return slab
                if on_wait is not None:
                    on_wait()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WaitTimeoutError(
                        f"waited {timeout_s:.0f}s for {nbytes} bytes of the memory budget ({self.budget_bytes}) "
                        "while uploads were in flight; raise memory_budget, or timeout_s if storage is slow"
                    )
                self._cond.wait(min(left, 1.0))

    def keep(self, slab: Slab) -> None:
        """``slab`` holds the kept snapshot: no save takes it until ``unkeep``."""
        with self._cond:
            slab.kept = True

    def unkeep(self, slab: Slab) -> None:
        """``slab`` no longer holds the kept snapshot: free once its uploads are done."""
        with self._cond:
            slab.kept = False
            if self.closed and slab in self._slabs and not slab.in_use:
                self._drop(slab)
            self._cond.notify_all()

    def adopt(self, segment: Segment, *, kept: bool) -> Slab | None:
        """A slab of ``segment`` (a snapshot a previous process kept), if the budget has room;
        None (the segment unlinked) otherwise."""
        with self._cond:
            if self.closed or self.allocated_bytes + segment.size > self.budget_bytes:
                segment.close()
                segment.unlink()
                return None
            slab = Slab(segment)
            slab.kept = kept
            self._slabs.append(slab)
            self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
            self._cond.notify_all()
            return slab

    def release(self, slab: Slab) -> None:
        with self._cond:
            slab.in_use = False
            if self.closed and slab in self._slabs:  # released after close: already dropped
                self._drop(slab)
            self._cond.notify_all()

    def close(self) -> None:
        """Unlink every slab, in use or not (a spare being made is finished and dropped too)."""
        with self._cond:
            self.closed = True
            while self._creating:
                self._cond.wait(1.0)
            for slab in list(self._slabs):
                self._drop(slab)
            self._cond.notify_all()
        self._spares.put(None)  # (a job queued before it finds the arena closed and makes nothing)
        if self._spare_maker is not threading.current_thread():
            self._spare_maker.join(timeout=30.0)


def _pin(t: torch.Tensor) -> bool:
    """Page-lock a slab so device-to-host copies run at full speed; False if refused."""
    try:
        err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0)
        return int(err) == 0
    except Exception:
        return False


def _unpin(t: torch.Tensor) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
    except Exception:
        pass
