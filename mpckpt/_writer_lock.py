"""The writer lock of each root this process writes to, and where in the program it was taken.

A root has one writer at a time (the storage's lock: ``Backend.acquire_writer_lock``). A second
Checkpointer of the same root in the same process is a program error worth naming: the lock
taken here remembers where the first was opened, and a refusal says so (after one garbage
collection: an unreachable, unclosed Checkpointer lets go of the lock in its finalizer).
"""

from __future__ import annotations

import gc
import threading

from mpckpt.errors import LockedError
from mpckpt.storage import Backend
from mpckpt.storage.base import WriterLock

_held: dict[str, str] = {}  # root URL -> where in the program its Checkpointer was opened
_held_lock = threading.Lock()


def acquire_writer_lock(backend: Backend, owner: str, where: str) -> WriterLock:
    """The root's writer lock; a clear error when this very process already holds it."""
    for attempt in (1, 2):
        try:
            lock = backend.acquire_writer_lock(owner)
        except LockedError as e:
            with _held_lock:
                opened_at = _held.get(backend.url)
            if opened_at is None:
                raise
            if attempt == 1:
                gc.collect()  # an unreachable, unclosed Checkpointer lets go in its finalizer
                continue
            raise LockedError(
                f"{backend.url} is held by another Checkpointer of this process, opened at {opened_at} and "
                "not closed yet; call close() on it first, or open Checkpointers with "
                "`with mpckpt.Checkpointer(...) as ckpt:`, which closes them at the end of the block"
            ) from e
        with _held_lock:
            _held[backend.url] = where
        return lock
    raise AssertionError("unreachable")


def release_writer_lock(backend: Backend, lock: WriterLock) -> None:
    with _held_lock:
        _held.pop(backend.url, None)
    lock.release()
