"""What an open Checkpointer holds, and letting go of it, also when nobody closed it.

An open Checkpointer holds the writer lock of its root, uploader processes, shared memory,
a committer, a deleter and a dispatcher thread (and, with ``validate=``, a validator thread
and process). ``Runtime`` owns all of them and never refers back to the ``Checkpointer`` (its
background threads reach only the runtime), so a Checkpointer that becomes unreachable without
``close()`` (a notebook variable bound again, a script without ``with``) can still be finalized.
Its finalizer, and an atexit hook for the end of the program, wait for the checkpoints saved
(bounded by ``timeout_s``), log every failure nobody has seen (never swallowed), free everything.

It handles a save once the Checkpointer has checked its arguments: whether it is due (the
trigger; after a preemption signal every save is, and synchronous; in a job one all_gather
makes the ranks agree), warming shared memory on the first save that is not, the snapshot
with the garbage collector paused; and ``report`` (the rules for a folder are
``_upload.directory``'s). What is opened for a root, and when opening is refused, is
``_opening``'s.

Nothing it starts stands between the open and a restored model, nor between a restore and
the first save after it: the uploaders start in the background (a save's jobs queue up while
they start and fail with why they could not, which the next save raises; a call that needs
them up waits, bounded: ``_uploaders_ready``), and a restore's shared memory is made in a
thread (``prepare``).

One process or a job, it is wired the same way around its ``group`` (a single process is a
group of one, ``_dist.group``): rank 0 holds the writer lock it took at the open
(``_opening.take_root``), every rank the rest; only rank 0 deletes. Where a job differs,
``group.alone`` says so once each: a rank saves its part of a checkpoint and commits it with
the others through the job's store (``_join``); it waits longer (``wait_s``).

A read-only Checkpointer holds none of that: ``_view.StorageView`` answers its questions
by looking at the root anew each time (another process writes there).

It also remembers which roots this process holds, so that a second Checkpointer on the same
root in the same process is told that, and how to close the first, instead of a puzzling
"another live process (pid <our own pid>)".
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mpckpt._commit.committer import Committer
from mpckpt._commit.coordinator import Coordinator, SingleProcess
from mpckpt._commit.deleter import Deleter
from mpckpt._commit.deletion import Deletions
from mpckpt._commit.readers import Readers
from mpckpt._commit.sink import ErrorSink
from mpckpt._dist.group import RankGroup
from mpckpt._dist.plan import Planner
from mpckpt._futures import CheckpointerStats, SaveFuture
from mpckpt._keep.keeper import Keeper
from mpckpt._ledger import Ledger, Pending
from mpckpt._preemption import PreemptionWatch
from mpckpt._save.budget import Budget
from mpckpt._save.saving import Snapshotter
from mpckpt._stage.arena import Arena
from mpckpt._system import shm as _shm
from mpckpt._threads import Thread
from mpckpt._upload.directory import DirectoryUploads
from mpckpt._upload.pool import UploaderPool
from mpckpt._view import ReadsCommitted
from mpckpt._writer_lock import release_writer_lock
from mpckpt.catalog import read_manifest
from mpckpt.config import Config, UploadMode
from mpckpt.errors import CheckpointNotFoundError, ConfigError, RankError
from mpckpt.format.manifest import Manifest
from mpckpt.format.names import checkpoint_name
from mpckpt.policies.triggers import Schedule
from mpckpt.storage import Backend, BackendSpec
from mpckpt.storage.base import WriterLock

if TYPE_CHECKING:  # validate= and a job's commits and tier are imported when used, not at every open
    from mpckpt._commit.validation import Validator
    from mpckpt._peer.tier import JobTier

log = logging.getLogger("mpckpt")

UPLOADERS_HELD_S = 5.0  # most an open's uploaders wait for a restore to read (their start slows it on few cores)


@dataclass
class Taken:
    """What rank 0 found when it took the root (``_opening.take_root``), as every rank learns it."""

    token: str | None  # a job's run token (staging folders, store keys); None for a single process
    committed: dict[int, Manifest]
    damaged: dict[int, Exception] = field(default_factory=dict)
    lock: WriterLock | None = None  # rank 0's writer lock


class Runtime(ReadsCommitted):
    """Everything one open Checkpointer holds, wired together: the pipeline of a checkpoint.

    ``save``: snapshotter (layout, budget, copy) -> uploader pool -> ledger -> committer
    (coordinator, retention, deleter). ``report``: directory uploads -> the same from the pool
    on. Background failures come out of one ``ErrorSink``.
    """

    read_only = False

    def __init__(self, config: Config, spec: BackendSpec, backend: Backend, *, environ: dict[str, str],
                 pin: bool, preemption: PreemptionWatch, group: RankGroup, taken: Taken,
                 validation: bytes | None = None) -> None:
        """``taken``: the root as rank 0 took it (its lock is let go of if this fails); ``validation``:
        ``validate=`` as ``_commit.validation.prepare`` gave it."""
        self.lock = taken.lock
        self.config = config
        self.group = group
        self.backend = backend
        self.spec = spec
        self.preemption = preemption
        self.warmed = False  # shared memory made ahead for the first save (prepare, or a trigger)
        self.closed = False
        self._readers = Readers()
        self._stats = CheckpointerStats()
        self.errors = ErrorSink()
        self.validator: Validator | None = None
        self.pool: UploaderPool | None = None
        self.committer: Committer | None = None
        self.deleter: Deleter | None = None
        self.arena: Arena | None = None
        self.keeper: Keeper | None = None
        self.tier: JobTier | None = None  # a job's recovery tier
        self.leave_in_memory = False  # close(): leave the kept snapshot for the next process
        try:
            self.schedule = Schedule(config.trigger, opened=time.monotonic())
            _shm.reap_orphans()
            # checkpoints whose manifest does not verify: never deleted, never saved over
            self.damaged = taken.damaged
            staging_name = functools.partial(backend.staging_name, run=taken.token)
            self.ledger = Ledger(taken.committed, staging_name=staging_name, on_open=self._opened,
                                 taken_steps=set(self.damaged))
            self.arena = Arena(config.memory_budget_bytes, pin=pin)
            self.pool = UploaderPool(spec, workers=config.workers, start_method=config.start_method,
                                     priority=config.uploader_priority, max_attempts=config.max_job_attempts,
                                     in_process=bool(getattr(backend, "process_local", False)), environ=environ)
            self.errors.add_source(self.pool.take_internal_error)
            # in the background, once a restore has read or a save needs them; fork: before threads run
            self.pool.start(wait=config.start_method == "fork", hold_s=UPLOADERS_HELD_S)
            # staging folders are the commit side's: staging is handed only the calls that make and
            # remove them (in a job a dropped step's folder is the coordinator's to remove)
            budget = Budget(config, self.arena, self.ledger, self.pool, on_wait=self.errors.raise_unseen,
                            abort_staging=backend.abort if group.alone else None)
            self.saver = Snapshotter(config, self.ledger, budget, self.pool, backend.prepare_staging, self._stats)
            # the snapshot a previous process kept in memory is found now; newer ones are kept as saved
            self.keeper = Keeper(backend.url, self.arena, enabled=config.keep_in_memory, rank=group.rank,
                                 world_size=group.world_size)
            self.saver.keeper = self.keeper
            self.directories = DirectoryUploads(config, self.ledger, self.pool, backend, local=spec.scheme == "file")
            self.deleter = Deleter(backend)
            if validation is not None:
                from mpckpt._commit.validation import Validator, ValidatorSetup
                self.validator = Validator(
                    ValidatorSetup(spec, validation, config.nice, os.getpid(), environ), ledger=self.ledger,
                    backend=backend, start_method=config.start_method, timeout_s=config.validate_timeout_s,
                    stats=self._stats.validations, after=self._validated)
            self.committer = Committer(self.ledger, backend, self._join(taken.token), self.deleter,
                                       retention=config.retention, on_forget=self.saver.frozen.forget_folder,
                                       let_go=self.saver.frozen.let_go, validating=self.validator is not None,
                                       held=self._in_use, deletes=group.rank == 0)
            self.deletions = Deletions(self.ledger, backend, self.saver.frozen, self.deleter,
                                       self.committer.retention_lock, self.validator, self.damaged,
                                       config.timeout_s, wait=self.wait, raise_unseen=self.errors.raise_unseen)
            if self.validator is not None:
                self.validator.resume(self.ledger.committed())
            preemption.install()
        except BaseException:
            if self.tier is not None:  # a failed open never removes what a previous process kept
                self.tier.close(leave=True)
            if self.keeper is not None:
                self.keeper.close(leave=True)
            self._stop_background(timeout_s=5)
            self._let_go_of_lock()
            raise
        atexit.register(self.release_unclosed)  # registered after multiprocess's hook: runs before it

    def _join(self, token: str | None) -> Coordinator:
        """Who publishes: a single process its own checkpoints (``SingleProcess``); a rank saves its
        part (``Planner``), holds the job's recovery tier (``JobTier``, a collective) and commits
        with the others through the store, under the run ``token`` (``StoreCoordinator``)."""
        group, config = self.group, self.config
        if group.alone:
            return SingleProcess(self.backend)
        from mpckpt._commit.ranked import StoreCoordinator
        assert self.keeper is not None and self.arena is not None
        self.saver.planner = Planner(group)
        if config.keep_in_memory:  # the job's memory and the copies on other nodes
            from mpckpt._peer.tier import JobTier
            self.tier = JobTier(self.keeper, self.arena, group, copies=config.peer_copies, token=str(token),
                                timeout_s=2 * config.job_timeout_s)
        return StoreCoordinator(self.backend, group.scoped(f"mpckpt/{token}/"), rank=group.rank,
                                world_size=group.world_size, timeout_s=config.timeout_s)

    def committed(self) -> dict[int, Manifest]:
        return self.ledger.committed()

    def in_memory(self) -> dict[int, Manifest]:
        """The snapshots found in memory, by step (``_keep``; a job's, wherever held: ``_peer``, a collective)."""
        if self.tier is not None:
            return self.tier.in_memory()
        return self.keeper.in_memory() if self.keeper is not None else {}

    def memory_source(self, manifest: Manifest) -> Any:
        if self.tier is not None:
            return self.tier.source_for(manifest)
        return self.keeper.source_for(manifest) if self.keeper is not None else None

    def done_reading(self) -> None:
        """A restore ended on every rank (or failed alike): other nodes' memory is no longer read."""
        if self.pool is not None:
            self.pool.go()
        if self.tier is not None:
            self.tier.done_reading()

    def restored(self, step: int | None) -> None:
        """A restore finished (``step``: what it restored): take over or drop what was found in memory."""
        if self.pool is not None:
            self.pool.go()  # the uploaders start now
        if self.tier is not None:
            self.tier.settle(step)
        if self.keeper is None:
            return
        durable = set(self.ledger.committed())
        self.keeper.settle(step, durable)
        if step is not None and step not in durable:  # restored from memory only: saves go on past it
            self.ledger.take_step(step)

    def complete(self, manifest: Manifest) -> Manifest:
        """``manifest`` with its files: a multi-rank summary (``Manifest.complete`` False, what
        ranks other than 0 learn at a commit) is read from storage, once."""
        if manifest.complete:
            return manifest
        full = read_manifest(self.backend, checkpoint_name(manifest.step))
        if full.seq != manifest.seq:
            raise CheckpointNotFoundError(f"the checkpoint of step {manifest.step} in {self.backend.url} is not the "
                                          "one this job committed (replaced by hand?)")
        self.ledger.update_committed(manifest.step, lambda _: full)
        return full

    @property
    def wait_s(self) -> float:
        """How long a wait for pending checkpoints may take by default: ``timeout_s``; in a
        multi-rank job twice that and a little more, since a step's commit waits up to
        ``timeout_s`` for the other ranks only once this rank's own uploads are done, and a
        wait must outlast it to give the ``RankError`` that names a dead rank."""
        return self.config.timeout_s if self.group.alone else 2 * self.config.timeout_s + 10.0

    def reading(self, step: int | None) -> contextlib.AbstractContextManager[None]:
        """Retention keeps ``step`` while this process reads it (``_commit.readers``)."""
        if step is None or self.committer is None:
            return contextlib.nullcontext()
        committer = self.committer
        return self._readers.reading(step, committer.retention_lock,
                                     lambda s: None if self.closed else committer.reapply_retention(s))

    def _in_use(self) -> set[int]:
        """Steps retention must keep for now: being read here, or awaiting or failing validation."""
        return self._readers.steps() | (self.validator.held() if self.validator is not None else set())

    def latest_step(self) -> int | None:
        return self.ledger.latest_step()

    def set_aside(self, steps: list[int], *, move: bool = True) -> list[str]:
        return self.deletions.set_aside(steps, move=move)  # see Deletions.set_aside

    def discard_after(self, step: int, *, keep: bool = False) -> list[int]:
        if not self.group.alone:
            raise ConfigError("discard_newer() is not available in a multi-rank job; delete the newer checkpoints "
                              "with `mpckpt rm` before the job starts")
        if keep:
            return self.deletions.set_aside_after(step)  # see Deletions.set_aside_after
        return self.deletions.discard_after(step)  # see Deletions.discard_after

    def delete(self, steps: list[int], *, damaged: bool) -> None:
        if not self.group.alone:
            raise ConfigError("delete() is not available in a multi-rank job (every rank would have to agree); let "
                              "retention (keep=) delete, or use `mpckpt rm ROOT STEP` once the job has stopped")
        self.deletions.delete(steps, damaged=damaged)  # see Deletions.delete (refusals: deletion.refuse)

    def forget_deleted(self) -> list[int]:
        return self.deletions.forget_deleted()  # see Deletions.forget_deleted

    def _opened(self, record: Pending) -> None:
        self._stats.saves.append(record.stats)
        self.errors.watch(record.future)
        if self.validator is not None:  # validate=: once committed, before retention decides
            self.ledger.after_commit(record, functools.partial(self.validator.submit, record.step))

    def _validated(self, step: int) -> None:
        """A validation finished: apply retention again (KeepBest can rank ``step`` now)."""
        if self.committer is not None:
            self.committer.reapply_retention(step)

    @property
    def stats(self) -> CheckpointerStats:
        """The figures of every save, with the pool's and the arena's counters as of now."""
        if self.pool is not None:
            self._stats.worker_restarts = self.pool.restarts
            self._stats.job_retries = self.pool.retries
        if self.arena is not None:
            self._stats.peak_shm_bytes = self.arena.peak_bytes
        return self._stats

    # -- saving (the Checkpointer has checked the arguments; ``started``: when its caller called) --
    def save(self, step: int, state: Any, metrics: dict[str, Any], *, mode: UploadMode, overlap: bool | None,
             force: bool, started: float, agreed: bool = False) -> SaveFuture | None:
        """Snapshot ``state`` as ``step`` if due (``Checkpointer.save``; ``agreed``: the ranks did, no collective);
        or raise a background failure nobody saw (in a job whose saves agree, after the collective)."""
        now = time.monotonic()
        preempted, due = self.preemption.preempted, force or self.schedule.due(step, now)
        failure = self.errors.first_unseen()
        if not agreed and (self.schedule.timed or self.preemption.signals):
            # the clock and signals differ per rank: one small collective makes every rank agree (a single
            # process's all_gather returns [mine]). INVARIANT: a rank about to raise runs it too, or its
            # next collective (the training's own) would pair with the others' of this save
            flags = self.group.all_gather((due, preempted, failure is not None))
            due, preempted = flags[0][0], any(p for _, p, _ in flags)
            if failure is None and (failing := [r for r, (_, _, f) in enumerate(flags) if f]):
                raise RankError(f"step {step} is not saved: rank(s) {failing} raised an earlier checkpoint's failure in "
                                "this save; no rank takes this step, the next save goes on", step=step, ranks=failing)
        if failure is not None:
            raise failure
        if preempted:  # the job is about to be stopped: this save is the last one
            force, mode, overlap = True, UploadMode.SYNC, False
        if mode is UploadMode.MEMORY:  # kept in memory only: every call is taken (the trigger is for uploads)
            self.saver.barrier()
            return self._returned(self.saver.save(step, state, metrics, overlap=False, memory=True), mode, started)
        if not force and not due:
            if not self.warmed:
                self._warm_in_background(state)
            return None
        if self.pool is not None:  # the snapshot is taken while the uploaders may still be starting: its jobs
            self.pool.going()      # wait in their queue (the first save after a restart does not wait for them)
        self.saver.barrier()
        overlap = self.config.overlap if overlap is None else bool(overlap)
        # A save allocates an object or two per tensor and creates no cycles: a collection
        # triggered in here would scan every live tensor on the training thread's time.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            future = self.saver.save(step, state, metrics, overlap=overlap and mode is UploadMode.ASYNC)
        finally:
            if gc_was_enabled:
                gc.enable()
        if future.stats.status != "skipped":
            self.schedule.saved(step, now)
        return self._returned(future, mode, started)

    def should_save(self, step: Any, check_step: Callable[[Any], int]) -> bool:
        """After a preemption signal always (``step`` unchecked); otherwise as the trigger says."""
        return self.preemption.preempted or self.schedule.due(check_step(step), time.monotonic())

    def report(self, step: int | None, metrics: dict[str, Any], checkpoint: Any, *, mode: UploadMode,
               delete_local: bool | None, started: float, check_step: Callable[[Any], int]) -> SaveFuture | None:
        """Record ``metrics``; with ``checkpoint``, commit its folder (see ``Checkpointer.report``).

        ``check_step``: the caller's check of the step, run after the refusals of the folder.
        """
        if step is None:
            last = self.ledger.last_step
            step = int(metrics["step"]) if "step" in metrics else (0 if last is None else last + 1)
        if checkpoint is None:
            self._stats.reported.append({"step": step, **metrics})
            return None
        self._uploaders_ready()
        record = self.directories.report_folder(step, metrics, checkpoint, mode=mode, delete_local=delete_local,
                                                multi_rank=not self.group.alone, check_step=check_step)
        return self._returned(record.future, mode, started)

    def _returned(self, future: SaveFuture, mode: UploadMode, started: float) -> SaveFuture:
        """Wait for the commit unless ASYNC; record how long the caller was blocked."""
        if mode in (UploadMode.SYNC, UploadMode.NO_UPLOAD):
            future.result(self.wait_s)
        future.stats.blocked_ms = (time.perf_counter() - started) * 1e3
        return future

    def prepare(self, state: Any, *, background: bool = False) -> int:
        """Make and touch shared memory for the first save of ``state`` (and plan it: ``Snapshotter.warm``)
        now, or (``background``, after a restore) in a thread that a first save waits for; one slab's bytes."""
        need = self.saver.slab_bytes_for(state)  # here: in a job it may agree with the other ranks
        assert self.arena is not None  # two slabs: the first save's, and the next one's while it uploads
        self.warmed = True
        if background:
            self.arena.ensure_spare(need, count=2)
            return need
        self.arena.reserve(need, count=2)
        self.saver.warm(state)  # the first saves' layout, views and checks, made now
        self._uploaders_ready()
        return need

    def _warm_in_background(self, state: Any) -> None:
        """The first save a trigger says is not due: make the first slab in the background.

        Creating and touching shared memory is most of a first save that nobody prepared
        for (the kernel allocates every page); a loop with a trigger shows its state long
        before the first due step, so that work runs beside training instead.
        """
        self.warmed = True
        assert self.arena is not None
        self.arena.ensure_spare(self.saver.slab_bytes_for(state))

    def _uploaders_ready(self, *, again: bool = True) -> None:
        """Wait (bounded) for the uploaders' start; raise its failure (``UploaderPool.ready``)."""
        if self.pool is not None:
            self.pool.ready(again=again)

    # -- closing -----------------------------------------------------------------------------
    def wait(self, timeout_s: float) -> None:
        """Block until every pending checkpoint is committed or failed and retention has deleted."""
        deadline = time.monotonic() + timeout_s
        self._uploaders_ready(again=False)
        self.saver.barrier()
        self.ledger.wait(timeout_s=timeout_s)
        if self.validator is not None:  # validate=: their metrics, and the retention that follows
            self.validator.wait(timeout_s=max(0.0, deadline - time.monotonic()))
        if self.deleter is not None:
            self.deleter.drain(timeout_s=max(0.0, deadline - time.monotonic()))
        for memory in (self.keeper, self.tier):  # the newest kept record's checksums; the copies on other nodes
            if memory is not None:
                memory.wait(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        """Wait for every pending checkpoint and free everything; raise failures nobody saw."""
        if self.closed:
            return
        try:
            self.wait(self.wait_s)
            self.errors.raise_unseen()
        finally:
            self.release()

    def release(self, *, timeout_s: float | None = None, abort: bool = False) -> None:
        """Free everything now: threads, uploader processes, shared memory, the lock (``timeout_s``:
        the most each background part may take to stop; default ``wait_s``; ``abort``: the job's
        group failed, the peer link's transfers fail at once: ``JobTier.close``)."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.release_unclosed)
        self.preemption.uninstall()
        try:
            self.saver.close()
            if self.tier is not None:
                self.tier.close(leave=self.leave_in_memory, abort=abort)
            if self.keeper is not None:  # before the arena unlinks the slabs: the record goes first
                self.keeper.close(leave=self.leave_in_memory)
            self._stop_background(timeout_s=self.wait_s if timeout_s is None else timeout_s)
        finally:
            self._let_go_of_lock()

    def _stop_background(self, *, timeout_s: float) -> None:
        # INVARIANT: the pool closes before the committer: a job it could not finish in time
        # fails, so its checkpoint settles and the committer can stop
        if self.pool is not None:
            self.pool.close(timeout_s=min(timeout_s, 30.0))
        if self.committer is not None:
            self.committer.close(timeout_s=timeout_s)
        if self.validator is not None:  # after the committer (it hands validations over), before the deleter
            self.validator.close(timeout_s=min(timeout_s, 30.0))
        if self.deleter is not None:
            self.deleter.close(timeout_s=timeout_s)
        if self.arena is not None:
            self.arena.close()

    def _let_go_of_lock(self) -> None:
        if self.lock is None:  # a rank other than 0 of a multi-rank job: rank 0 holds it
            return
        release_writer_lock(self.backend, self.lock)

    def release_unclosed(self) -> None:
        """The finalizer of a Checkpointer nobody closed (also run at exit): close, never raise."""
        if self.closed:
            return
        if threading.current_thread().name.startswith("mpckpt-"):
            # collected on one of our own threads, which close() joins: let another thread do it
            Thread(target=self.release_unclosed, name="finalizer of an mpckpt Checkpointer").start()
            return
        warnings.warn(f"mpckpt: a Checkpointer of {self.backend.url} was not closed; closing it now "
                      "(use `with mpckpt.Checkpointer(...)` or call close())", ResourceWarning, stacklevel=2)
        self.leave_in_memory = True  # the program may be ending on an error: a restart may want it
        try:
            self.close()
        except BaseException as e:  # nobody is left to raise it to: log it, never swallow it
            log.error("mpckpt: closing the unclosed Checkpointer of %s: %s: %s", self.backend.url,
                      type(e).__name__, e, exc_info=e)
            for other in self.errors.take_unseen():
                log.error("mpckpt: %s: %s", type(other).__name__, other)
        finally:
            self.release()
