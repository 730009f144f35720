"""``Checkpointer``: the context manager a training loop holds; the public face of the pipeline.

It validates what the caller passes (steps, metrics, modes), holds the public API, and
delegates everything else to the ``Runtime`` it opens, which never refers back to it:

    open    -> _opening.open_root (read-only or writing, one process or a job: what may open)
               -> _runtime.Runtime, or _view.StorageView when read-only
    save    -> Runtime.save (due, preempted, warming) -> _save.saving.Snapshotter (layout, budget,
               reuse, copy) -> _upload.pool
    report  -> Runtime.report (the folder's rules) -> _upload.directory.DirectoryUploads -> _upload.pool
            -> _ledger (records, order) -> _commit.committer (coordinator, retention, deleter)
    queries -> _view.ReadsCommitted (steps, best, checkpoint, load) over the committed checkpoints
    restore -> _read.restore (the newest readable step, its sources nearest first, apply)
    errors  -> _commit.sink.ErrorSink

Opening it checks the root, takes the single-writer lock, removes what a crashed run left
(``catalog.recover``), and starts the uploader processes, which warm up while ``restore`` runs
(the first ``save`` waits for them, and raises if they cannot write to the root). ``save``
returns once the state is copied (ASYNC) or committed (SYNC); leaving the block waits for all
of it and raises what failed.

``read_only=True`` opens none of that (``_view.StorageView``): it lists and restores while
another process writes. ``preemption=`` installs signal handlers (``_preemption``) that make
the next ``save`` a due, synchronous one. ``validate=`` runs a function on each committed
checkpoint in a process of its own (``_commit.validation``); its metrics join the
checkpoint's, and its failures are logged, never raised (the checkpoint stays).

Errors from the background surface exactly once: on the future if the caller looks there,
otherwise at the next ``save``, ``report``, ``wait`` or exit, naming the step and the cause.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mpckpt._futures import CheckpointerStats, LastRestore, SaveFuture
from mpckpt._opening import open_root
from mpckpt._read.restore import restore as restore_state
from mpckpt._runtime import Runtime
from mpckpt._view import (
    StorageView,
    load,  # noqa: F401 -- mpckpt.load, kept importable here
)
from mpckpt.checkpoint import Checkpoint
from mpckpt.config import SETTINGS, BudgetPolicy, Config, UploaderPriority, UploadMode
from mpckpt.errors import (
    ConfigError,
    MpckptError,
    StepOrderError,
    add_note,
)
from mpckpt.options import GROUPS, Job, Memory, Retention, Uploads, gather
from mpckpt.policies.retention import RetentionPolicy
from mpckpt.policies.triggers import Trigger

log = logging.getLogger("mpckpt")


class Checkpointer:
    """Asynchronous checkpoints of a training state into ``root`` (a path or URL). Settings (declared in
    ``config.SETTINGS``) come grouped, ``memory=Memory(budget="8GiB")``, or as flat keywords,
    ``memory_budget="8GiB"``; one given both ways with different values is a ``ConfigError``."""

    def __init__(
        self, root: str | os.PathLike[str], *,
        memory: Memory | None = None, uploads: Uploads | None = None, retention: Retention | None = None,
        job: Job | None = None,   # the groups; each of their fields is also a flat keyword (a shorthand):
        memory_budget: int | str | float | None = None, policy: str | BudgetPolicy | None = None,
        overlap: bool | None = None, keep_in_memory: bool | None = None, workers: int | None = None,
        uploader_priority: str | UploaderPriority | None = None, start_method: str | None = None,
        job_timeout_s: float | None = None, keep_last: int | None = None, keep: RetentionPolicy | None = None,
        trigger: Trigger | None = None, process_group: Any = None, peer_copies: int | None = None,
        timeout_s: float | None = None, allow_pickle: bool = False, preemption: bool | Sequence[int | str] = False,
        validate: Callable[[Checkpoint], Mapping[str, float]] | None = None, validate_timeout_s: float | None = None,
        storage_options: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None,
        read_only: bool = False,
    ) -> None:
        args = locals()  # INVARIANT: every declared keyword is a parameter (tests/unit/test_settings.py)
        given = gather({s.name: args[s.name] for s in SETTINGS if s.keyword}, {g: args[g] for g in GROUPS})
        opened = open_root(self, root, Config.resolve(environ=environ, **given), storage_options=storage_options,
                           read_only=read_only)
        self.config, self._spec = opened.config, opened.spec  # writing: the budget fitted to /dev/shm
        # the runtime never refers back to this Checkpointer: an unclosed one nobody holds is finalized
        self._rt: Runtime | StorageView = opened.runtime
        self._finalizer = opened.finalizer

    @property
    def stats(self) -> CheckpointerStats:
        """Figures of every save and report, and the uploaders' restart and retry counters."""
        return self._rt.stats

    @property
    def last_restore(self) -> LastRestore | None:
        """The step the last ``restore`` restored, its source (memory, peer, storage), seconds, bytes."""
        return self._rt.stats.last_restore

    @property
    def _closed(self) -> bool:
        return getattr(self, "_rt", None) is None or self._rt.closed

    @property
    def url(self) -> str:
        """Where the checkpoints go (never with credentials)."""
        return self._rt.backend.url

    @property
    def read_only(self) -> bool:
        """Opened with ``read_only=True``: lists, loads and restores; never saves or deletes."""
        return self._rt.read_only

    @property
    def preempted(self) -> bool:
        """A preemption signal arrived (``preemption=``): save, then stop the loop. Stays True."""
        return isinstance(self._rt, Runtime) and self._rt.preemption.preempted

    def _writer(self, *, unseen: bool = True) -> Runtime:
        """The runtime of a Checkpointer that may write (a clear error for a read-only one)."""
        self._check_usable(unseen=unseen)
        if not isinstance(self._rt, Runtime):
            raise ConfigError(f"this Checkpointer of {self.url} was opened with read_only=True: it lists, loads and "
                              "restores, and never saves; open one without read_only in the process that trains")
        return self._rt

    @property
    def uploader_pids(self) -> list[int]:
        """Process ids of the uploader processes (empty when uploads run in threads of this process)."""
        pool = self._rt.pool
        return [] if pool is None or pool.in_process else list(pool.pids)

    # -- context manager ----------------------------------------------------------------------
    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            self.close(leave_in_memory=exc_type is not None)  # after an error, a restart may want it
        except BaseException as e:
            if exc_type is None:
                raise
            add_note(exc, f"mpckpt: while closing after this error: {type(e).__name__}: {e}")  # keep the body's

    def close(self, *, leave_in_memory: bool = False) -> None:
        """Wait for every pending upload, stop the uploaders, free shared memory; raise failures.
        ``leave_in_memory``: the snapshot kept in memory stays for the next process of this root (as
        leaving a ``with`` block by an exception does, and the finalizer or exit of an unclosed one,
        which logs what failed instead of raising it)."""
        if self._closed:
            return
        if self._finalizer is not None:
            self._finalizer.detach()
        self._rt.leave_in_memory = leave_in_memory
        self._rt.close()

    # -- saving ---------------------------------------------------------------------------------
    def save(self, step: int, state: Any, *, metrics: Mapping[str, Any] | None = None,
             mode: UploadMode | str = UploadMode.ASYNC, overlap: bool | None = None,
             force: bool = False) -> SaveFuture | None:
        """Snapshot ``state`` for ``step``; return once copied (ASYNC) or committed (SYNC).

        With a ``trigger``, a step that is not due returns None at once (nothing copied);
        ``force`` saves regardless. With ``overlap`` (default: the checkpointer's setting) the
        copy of parameters and optimizer state runs in the background until the next
        ``optimizer.step()``. After a preemption signal (``preemption=``) every save is due and
        returns after its commit.
        """
        started = time.perf_counter()
        rt = self._writer(unseen=False)  # raised by the runtime's save: in a job, after the ranks agree
        mode = _mode(mode)
        if mode is UploadMode.NO_UPLOAD:
            raise ConfigError("mode=NO_UPLOAD registers files already stored; use it with report(checkpoint=...)")
        step = _check_step(step, rt.ledger.last_step)
        return rt.save(step, state, _check_metrics(metrics), mode=mode, overlap=overlap, force=force, started=started)

    def should_save(self, step: int) -> bool:
        """Whether ``save(step, ...)`` would save now (always True without a ``trigger``, and after a
        preemption signal)."""
        return self._writer().should_save(step, _check_int)

    def snapshot_barrier(self) -> None:
        """Wait until an overlapped snapshot has finished copying.

        ``optimizer.step()`` calls this for you; call it before any other in-place change of
        parameters or optimizer state (an EMA update, a manual weight edit).
        """
        if not self._closed and isinstance(self._rt, Runtime):
            self._rt.saver.barrier()

    def report(self, metrics: Mapping[str, Any] | None = None, checkpoint: Checkpoint | None = None, *,
               step: int | None = None, mode: UploadMode | str = UploadMode.ASYNC,
               delete_local_after_upload: bool | None = None) -> SaveFuture | None:
        """Record metrics and, with ``checkpoint``, upload and commit a folder the user wrote.

        By default the local folder is deleted after an ASYNC upload and kept after a SYNC one.
        ``NO_UPLOAD`` commits a folder that is already on the checkpoint filesystem by moving it
        into place (local roots only).
        """
        started = time.perf_counter()
        rt = self._writer()
        mode = _mode(mode)
        return rt.report(step, _check_metrics(metrics), checkpoint, mode=mode, delete_local=delete_local_after_upload,
                         started=started, check_step=lambda s: _check_step(s, rt.ledger.last_step))

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until every pending checkpoint is committed or failed, and every pending
        validation (``validate=``) has finished; raise unseen upload failures. By default the wait
        is bounded by ``timeout_s`` (in a job: twice that and ten seconds, so that a dead rank is
        reported by name, as a ``RankError``)."""
        if self._closed:
            return
        self._rt.wait(self._rt.wait_s if timeout_s is None else timeout_s)
        self._rt.errors.raise_unseen()

    def delete(self, *steps: int, damaged: bool = False) -> None:
        """Delete the checkpoints of ``steps`` now, whatever the retention policy says. Every other
        checkpoint stays loadable (a shared file goes once no checkpoint lists it); the
        newest may go too (its step is not saved again), once no save is pending. Refused as a
        whole, before anything is deleted (``_commit.deletion.refuse``): a step that is not there, a
        damaged one unless ``damaged=True`` (it may be recoverable), a folder another checkpoint
        reads files from (written before shared files) unless deleted with it, one being validated.
        Each folder's manifest goes first, so a reader never finds one half deleted.
        """
        self._check_usable()
        if not steps:
            raise ConfigError("delete() needs the steps of the checkpoints to delete")
        self._writer().delete([_check_int(s) for s in steps], damaged=damaged)

    def discard_newer(self, step: int, *, keep: bool = False) -> list[int]:
        """Delete the committed checkpoints newer than ``step``, so that saving goes on from there
        (a run that got to ``step`` another way: a framework's own resume; ``0``: a fresh start); the
        steps. Waits for pending saves; refused when a damaged one newer than ``step`` is in the way
        (``StepOrderError``) and in a job (``ConfigError``). ``keep=True`` deletes nothing: each
        goes, whole, to ``superseded.step_<step>.<UTC time>`` (damaged ones: ``damaged.``), kept."""
        self._check_usable()
        return self._writer().discard_after(_check_int(step), keep=bool(keep))

    def forget_deleted(self) -> list[int]:
        """Stop listing the committed checkpoints someone else deleted (a framework's retention, such
        as Ray Train's ``num_to_keep``, ``mpckpt rm``) but the newest; the steps no longer listed."""
        return self._writer().forget_deleted()

    def _check_usable(self, *, unseen: bool = True) -> None:
        if self._closed:
            raise MpckptError("this Checkpointer is closed; open a new one")
        if unseen:  # a background failure nobody saw yet
            self._rt.errors.raise_unseen()

    def prepare(self, state: Any) -> int:
        """Create and touch shared memory for ``state`` now (as its first save would need).

        ``restore`` starts it in the background. Returns the bytes of one slab. In a job it
        reserves what this rank writes (its shards, its share of the replicated tensors), which
        the first call for a state shape agrees with the other ranks: every rank calls it.
        """
        return self._writer().prepare(state)

    # -- reading ----------------------------------------------------------------------------------
    @property
    def latest_step(self) -> int | None:
        """The newest committed step (never moves past an uncommitted one)."""
        return self._rt.latest_step()

    def steps(self) -> list[int]:
        """Committed steps, oldest first."""
        return self._rt.catalog().steps()

    def best(self, n: int = 1, metric: str = "loss", mode: str = "min") -> list[int]:
        """The ``n`` committed steps with the best ``metric`` (``mode`` 'min' or 'max'; NaN never wins)."""
        return self._rt.catalog().best(n, metric, mode)

    def checkpoint(self, step: int | None = None) -> Checkpoint:
        """The committed checkpoint of ``step`` (default: the latest) as a ``Checkpoint``."""
        return self._rt.checkpoint(step)

    def load(self, step: int | None = None, *, classes: bool = True) -> Any:
        """The plain nested state of a committed checkpoint (default: the latest).

        ``classes=False``: namedtuples and dataclasses as dicts, Enum members as names (see ``mpckpt.load``).
        While it reads, this Checkpointer's retention keeps that checkpoint.
        """
        return self._rt.load(step, allow_pickle=self.config.allow_pickle, classes=classes)

    def restore(self, state: Any, *, step: int | None = None, fallback: bool = False, strict: bool = True,
                discard_newer: bool = False) -> int | None:
        """Load the latest committed state checkpoint (or ``step``) into ``state`` in place.

        Returns the restored step, or None when there is none yet (``_read.restore``). Directory
        checkpoints (``report``) do not count. A newest one that does not verify is a
        ``CorruptCheckpointError`` naming the newest older one that does; with ``fallback`` that one
        is restored and the damaged newer ones are moved aside whole (``damaged.step_*``), so the
        run saves their steps again. ``strict`` (as ``load_state_dict``): keys only one side has
        are a ``StateError`` naming them; ``strict=False`` restores the keys that match.
        ``discard_newer`` (with ``step``): delete the newer checkpoints, so the run goes on from
        there. Logs where it restored from (INFO); then warms shared memory for saving in the background.
        """
        self._check_usable()
        if discard_newer and step is None:
            raise ConfigError("discard_newer=True needs step=: the checkpoint the run goes on from")
        if discard_newer and not self._writer().group.alone:
            raise ConfigError("discard_newer=True is not available in a multi-rank job; delete the newer "
                              "checkpoints with `mpckpt rm` before the job starts")
        restored = restore_state(self._rt, state, step=None if step is None else _check_int(step),
                                 fallback=fallback, strict=strict, allow_pickle=self.config.allow_pickle,
                                 stats=self.stats)
        if discard_newer and restored is not None:
            self._writer().discard_after(restored)
        if not self.read_only:
            self._writer().prepare(state, background=True)  # off the path to a usable model
        return restored


def _check_int(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, int) and not hasattr(step, "__index__"):
        raise ConfigError(f"step={step!r} must be an int")
    step = int(step)
    if step < 0:
        raise ConfigError(f"step={step} must not be negative")
    return step


def _check_step(step: Any, last: int | None) -> int:
    """``step`` as an int after the last saved step ``last`` (``StepOrderError`` if not)."""
    step = _check_int(step)
    if last is not None and step <= last:
        raise StepOrderError(
            f"step {step} is not after the last saved step {last}; steps must increase "
            "(committed checkpoints are never overwritten). To go on from an earlier checkpoint, restore it "
            "with restore(state, step=N, discard_newer=True), which deletes the newer ones; to keep them, "
            "save the new branch into another root"
        )
    return step


def _mode(mode: Any) -> UploadMode:
    try:
        return mode if isinstance(mode, UploadMode) else UploadMode(str(mode).lower())
    except ValueError:
        raise ConfigError(f"mode={mode!r} is not one of {[m.value for m in UploadMode]}") from None


def _check_metrics(metrics: Mapping[str, Any] | None) -> dict[str, Any]:
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise ConfigError(f"metrics must be a dict of names to numbers, got {type(metrics).__name__}")
    return {str(k): (v.item() if hasattr(v, "item") and callable(v.item) else v) for k, v in metrics.items()}
