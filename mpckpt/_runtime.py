"""What an open Checkpointer holds, and letting go of it, also when nobody closed it.

An open Checkpointer holds the writer lock of its root, uploader processes, shared memory,
a committer and a dispatcher thread. ``Runtime`` owns all of them and never refers back to
the ``Checkpointer`` (its background threads reach only the runtime), so a Checkpointer that
becomes unreachable without ``close()`` (a notebook variable bound again, a script without
``with``) can still be finalized. Its finalizer, and an atexit hook for the end of the
program, wait for the checkpoints already saved (bounded by ``timeout_s``), log every failure
nobody has seen (never swallowed), and free everything.

It also remembers which roots this process holds, so that a second Checkpointer on the same
root in the same process is told that, and how to close the first, instead of a puzzling
"another live process (pid <our own pid>)".
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import threading
import traceback
import warnings
import weakref
from collections.abc import Callable
from typing import Any

from mpckpt import _shm
from mpckpt._arena import Arena
from mpckpt._futures import CheckpointerStats, SaveFuture
from mpckpt._ledger import Ledger, Pending
from mpckpt._pool import UploaderPool
from mpckpt._saving import Snapshotter
from mpckpt.catalog import recover
from mpckpt.config import Config
from mpckpt.errors import LockedError, add_note
from mpckpt.format.manifest import Manifest, checkpoint_name
from mpckpt.storage import Backend, BackendSpec
from mpckpt.storage.base import WriterLock

log = logging.getLogger("mpckpt")

_held: dict[str, str] = {}  # root URL -> where in the program its Checkpointer was opened
_held_lock = threading.Lock()


def caller_location() -> str:
    """``file:line`` of the first frame outside mpckpt (where the user opened the Checkpointer)."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    for frame in reversed(traceback.extract_stack()):
        if not os.path.abspath(frame.filename).startswith(package):
            return f"{frame.filename}:{frame.lineno}"
    return "<unknown>"


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


class Runtime:
    """The lock, uploader pool, arena, ledger and snapshotter of one open Checkpointer."""

    def __init__(self, config: Config, spec: BackendSpec, backend: Backend, *, environ: dict[str, str],
                 owner: str, where: str, pin: bool) -> None:
        self.config = config
        self.backend = backend
        self.closed = False
        self.stats = CheckpointerStats()
        self.futures: list[SaveFuture] = []
        self.lock = acquire_writer_lock(backend, owner, where)
        self.pool: UploaderPool | None = None
        try:
            _shm.reap_orphans()
            found = recover(backend)
            # checkpoints whose manifest does not verify: never deleted, never saved over
            self.damaged = found.damaged
            self.ledger = Ledger(backend, found.committed, on_committed=self.after_commit,
                                 taken_steps=set(self.damaged))
            self.arena = Arena(config.memory_budget_bytes, pin=pin)
            self.pool = UploaderPool(spec, workers=config.workers, start_method=config.start_method,
                                     nice=config.nice, max_attempts=config.max_job_attempts,
                                     in_process=bool(getattr(backend, "process_local", False)), environ=environ)
            self.pool.start()
            self.saver = Snapshotter(config, backend, spec.root, self.ledger, self.arena, self.pool,
                                     on_wait=self.raise_unseen)
        except BaseException:
            if self.pool is not None:
                self.pool.close(timeout_s=5)
            if hasattr(self, "ledger"):
                self.ledger.close(timeout_s=5)
            if hasattr(self, "arena"):
                self.arena.close()
            self._let_go_of_lock()
            raise
        atexit.register(self.release_unclosed)  # registered after multiprocess's hook: runs before it

    # -- errors from the background ---------------------------------------------------------
    def take_unseen(self) -> list[BaseException]:
        """Failures nobody has seen yet (each is returned once), and the pool's counters."""
        assert self.pool is not None
        errors: list[BaseException] = []
        internal = self.pool.take_internal_error()
        if internal is not None:
            errors.append(internal)
        for fut in self.futures:
            exc = fut._unseen_exception()
            if exc is not None:
                errors.append(exc)
        self.futures = [f for f in self.futures if not f.done()]
        self.stats.worker_restarts = self.pool.restarts
        self.stats.job_retries = self.pool.retries
        self.stats.peak_shm_bytes = self.arena.peak_bytes
        return errors

    def raise_unseen(self) -> None:
        errors = self.take_unseen()
        if errors:
            first = errors[0]
            for other in errors[1:]:
                add_note(first, f"also failed: {other}")
            raise first

    # -- retention ---------------------------------------------------------------------------
    def after_commit(self, record: Pending, manifest: Manifest) -> Callable[[], None] | None:
        """Apply retention: forget doomed checkpoints now, return the deletion to run later."""
        keep = self.config.keep_last
        if keep is None:
            return None
        from mpckpt.retention import keep_last_n

        with self.ledger.lock:
            committed = sorted(self.ledger.committed.items())
            referenced = {e.ref for _, m in committed for e in m.files.values() if e.ref}
            doomed = [checkpoint_name(step) for (step, _), keep_it in
                      zip(committed, keep_last_n(committed, keep), strict=True)
                      if not keep_it and checkpoint_name(step) not in referenced]
            for name in doomed:
                self.saver.forget_folder(name)
                self.ledger.committed.pop(int(name.removeprefix("step_")), None)

        def delete() -> None:
            for name in doomed:
                self.backend.delete(name)

        return delete if doomed else None

    # -- closing -----------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for every pending checkpoint and free everything; raise failures nobody saw."""
        if self.closed:
            return
        try:
            self.saver.barrier()
            self.ledger.wait(timeout_s=self.config.timeout_s)
            self.raise_unseen()
        finally:
            self.release()

    def release(self) -> None:
        """Free everything now: threads, uploader processes, shared memory, the lock."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.release_unclosed)
        try:
            self.saver.close()
            # INVARIANT: the pool closes before the ledger: a job it could not finish in time
            # fails, so its checkpoint settles and the committer can stop
            if self.pool is not None:
                self.pool.close()
            self.ledger.close(timeout_s=self.config.timeout_s)
            self.arena.close()
        finally:
            self._let_go_of_lock()

    def _let_go_of_lock(self) -> None:
        with _held_lock:
            _held.pop(self.backend.url, None)
        self.lock.release()

    def release_unclosed(self) -> None:
        """The finalizer of a Checkpointer nobody closed (also run at exit): close, never raise."""
        if self.closed:
            return
        if threading.current_thread().name.startswith("mpckpt-"):
            # collected on one of our own threads, which close() joins: let another thread do it
            threading.Thread(target=self.release_unclosed, name="finalizer of an mpckpt Checkpointer").start()
            return
        warnings.warn(f"mpckpt: a Checkpointer of {self.backend.url} was not closed; closing it now "
                      "(use `with mpckpt.Checkpointer(...)` or call close())", ResourceWarning, stacklevel=2)
        try:
            self.close()
        except BaseException as e:  # nobody is left to raise it to: log it, never swallow it
            log.error("mpckpt: closing the unclosed Checkpointer of %s: %s: %s", self.backend.url,
                      type(e).__name__, e, exc_info=e)
            for other in self.take_unseen():
                log.error("mpckpt: %s: %s", type(other).__name__, other)
        finally:
            self.release()


def finalizer_for(owner: Any, runtime: Runtime) -> Any:
    """Run ``runtime.release_unclosed`` when ``owner`` is collected (the atexit side is the runtime's)."""
    fin = weakref.finalize(owner, runtime.release_unclosed)
    fin.atexit = False
    return fin
