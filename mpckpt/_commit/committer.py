"""The committer thread: publishes settled checkpoints in save order, then does what follows.

For each record the ledger hands over (``Ledger.next_settled``, strictly in sequence order):

* persisted: write the small files (the skeleton), build the manifest, and let the
  coordinator publish it (``Coordinator.commit``: the manifest is written last), and log one
  INFO line (step, MiB written, blocked ms, persist ms, MB/s, how long after its save it
  became durable and how many later saves were still waiting). Then, in
  this order: the record's after-commit work (what later saves may reference, deleting the
  user's local folder after an upload), the retention policy's decision (the doomed
  checkpoints are forgotten at once, so nothing lists or references them again, and so are
  their shared files that no committed or pending checkpoint lists any more), the caller's
  future, and last the deletion, handed to the ``Deleter`` so the next commit never waits for it;
* failed: abort its staging folder, delete what it wrote into ``shared/``, and fail its
  future with an ``UploadError`` naming the step and the cause;
* dropped (skipped or coalesced): resolve its future with no checkpoint.

INVARIANT: nothing after the commit can undo it or stop later commits: a failure in
after-commit work or retention is logged, and the next record is committed regardless.

Durability may lag behind saving: on a machine whose CPUs training keeps busy, uploaders at
the default ``idle`` priority get little time, and saves pile up in shared memory, taken but
not durable. A crash then loses every step since the newest committed one. When more than
``LAG_WARNING_SAVES`` later saves were already taken as a checkpoint commits, the committer
warns once, saying what it costs and what to do; again only each time the pile doubles.

With ``validate=`` the after-commit work hands the checkpoint to the validator
(``_commit/validation.py``); retention never deletes a step it ``held`` (validation queued,
running or failed), and ``reapply_retention`` runs it again once a validation has finished
(one decision at a time: ``retention_lock``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mpckpt._commit.coordinator import Coordinator, StepDropped
from mpckpt._commit.deleter import Deleter
from mpckpt._ledger import Ledger, Pending
from mpckpt._threads import Thread
from mpckpt.errors import MpckptError, UploadError, upload_error
from mpckpt.format.manifest import MANIFEST_NAME, FileEntry, Manifest, checkpoint_name, checksum, format_version_for
from mpckpt.policies.retention import RetentionPolicy
from mpckpt.storage import Backend

log = logging.getLogger("mpckpt")

# more later saves than this already taken when a checkpoint commits: durability lags, warn
LAG_WARNING_SAVES = 3


@dataclass(eq=False)
class Committer:
    """One thread that commits the ledger's records in order, with retention after each."""

    ledger: Ledger
    backend: Backend
    coordinator: Coordinator
    deleter: Deleter
    retention: RetentionPolicy | None = None
    on_forget: Callable[[str], None] | None = None  # a folder retention deletes: never reference it again
    # the shared files of deleted checkpoints that nothing lists any more (``FrozenShards.let_go``)
    let_go: Callable[[list[Manifest]], list[str]] | None = None
    validating: bool = False  # validate= given: manifests say a validation.json may join metrics
    held: Callable[[], set[int]] | None = None  # steps retention must keep (validation pending or failed)
    # whether this process deletes what retention lets go of (in a multi-rank job only rank 0
    # does; the others forget the same checkpoints, so every rank lists the same ones)
    deletes: bool = True
    _thread: threading.Thread = field(init=False)
    retention_lock: threading.Lock = field(init=False, default_factory=threading.Lock)
    _lag_warned_at: int = field(init=False, default=0)  # saves waiting when the lag warning was last given

    def __post_init__(self) -> None:
        self._thread = Thread(target=self._run, name="mpckpt-committer", daemon=True)
        self._thread.start()

    def close(self, *, timeout_s: float) -> None:
        """Commit what is pending (bounded by ``timeout_s``) and stop."""
        self.ledger.stop()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while (record := self.ledger.next_settled()) is not None:
            try:
                self._finish(record)
            finally:
                self.ledger.retire(record)

    def _finish(self, record: Pending) -> None:
        told = False  # whether the coordinator already knows this record's outcome
        if record.outcome == "persisted":
            told = True  # ``_commit`` tells it, whatever happens
            try:
                manifest = self._commit(record)
            except StepDropped as e:  # another rank of the job dropped it: no rank commits it
                log.warning("mpckpt: %s", e)
                record.stats.status = "skipped"
                record.future._resolve(None)
                return
            except BaseException as e:
                self.ledger.mark_failed(record, e)
            else:
                self.ledger.mark_committed(record, manifest)
                stats = record.stats
                log.info("mpckpt: committed step %d to %s: %.1f MiB written, blocked %.1f ms, persisted in %.1f ms "
                         "(%.0f MB/s), durable %.2f s after save, %s waiting", record.step, self.backend.url,
                         stats.written_bytes / 2**20, stats.blocked_ms, stats.persist_ms, stats.mb_per_s,
                         stats.durable_ms / 1e3, _saves(stats.waiting))
                self._warn_if_lagging(record)
                for work in record.after_commit:
                    _run_quietly(work, record.step, "after committing")
                with self.retention_lock:
                    doomed, shared = self._apply_retention(record.step)
                record.future._resolve(record.name)
                if self.deletes:
                    self.deleter.delete(doomed, shared=shared)  # after the caller has its answer
                return
        if record.outcome == "failed":
            if not told:
                self.coordinator.abandon(record.step, record.staging, "failed", _reason(record.error))
            _run_quietly(lambda: self.coordinator.abort(record.staging), record.step, "removing the failed attempt of")
            self._drop_shared(record)
            error = record.error
            if not isinstance(error, UploadError):
                error = upload_error(record.step, "checkpoint not committed", error)
            record.future._fail(error)
            return
        self.coordinator.abandon(record.step, record.staging, "dropped", record.stats.status)
        record.future._resolve(None)  # dropped: skipped or coalesced, status set by the caller

    def _warn_if_lagging(self, record: Pending) -> None:
        """Warn when more than ``LAG_WARNING_SAVES`` later saves were taken before ``record``
        became durable: once, and again only when the pile has doubled since the last warning."""
        waiting = record.stats.waiting
        if waiting <= LAG_WARNING_SAVES or waiting < 2 * self._lag_warned_at:
            return
        self._lag_warned_at = waiting
        log.warning(
            "mpckpt: durability lags behind saving: step %d became durable %.2f s after its save, when %s "
            "(up to step %s) were already taken and not yet durable. A crash now loses every step since the newest "
            "durable one (step %d), not just those since the last save. The uploaders get too little CPU time or "
            "bandwidth: let them compete with training with uploader_priority='low' or 'normal' "
            "(MPCKPT_UPLOADER_PRIORITY; the default 'idle' runs them only when a core is free), give more workers= "
            "(MPCKPT_WORKERS) for slow storage, or save less often (fewer, larger saves). "
            "Said again only if the number of saves waiting doubles", record.step, record.stats.durable_ms / 1e3,
            _saves(waiting, "later save"), self.ledger.last_step, record.step)

    def _commit(self, record: Pending) -> Manifest:
        try:
            files = dict(record.files)
            self.backend.prepare_staging(record.staging)  # made already unless no job wrote into it
            for rel, content in record.small_files.items():
                data = content() if callable(content) else content
                self.backend.write_file(f"{record.staging}/{rel}", [data])
                files[rel] = FileEntry(len(data), checksum(data))
            manifest = Manifest(step=record.step, seq=record.seq, kind=record.kind, files=files,
                                metrics=record.metrics, format_version=format_version_for(record.kind, files),
                                world_size=self.coordinator.world_size,
                                figures=_figures(record, self.ledger.waiting_after(record)),
                                validate=self.validating)
        except BaseException as e:  # other ranks must not wait for a part that never comes
            self.coordinator.abandon(record.step, record.staging, "failed", _reason(e))
            raise
        # INVARIANT: every data file is durable before the manifest is written (commit does it last).
        return self.coordinator.commit(record.staging, record.name, manifest)

    def _drop_shared(self, record: Pending) -> None:
        """Delete what a failed save wrote into ``shared/`` (new names: nothing else lists them),
        unless its manifest landed after all (a lost reply): then the next open decides."""
        if not record.shared:
            return
        try:
            if self.backend.exists(f"{record.name}/{MANIFEST_NAME}"):
                return
        except MpckptError:
            return  # cannot tell: `mpckpt gc` and the next open remove what no manifest lists
        self.deleter.delete([], shared=sorted(record.shared.values()))

    def reapply_retention(self, step: int) -> None:
        """Apply retention again (a validation of ``step`` gave it its metrics, or failed)."""
        with self.retention_lock:
            doomed, shared = self._apply_retention(step)
        if self.deletes:
            self.deleter.delete(doomed, shared=shared)

    def _apply_retention(self, step_done: int) -> tuple[list[str], list[str]]:
        """Forget the checkpoints the policy lets go of; return their folders, and the shared
        files nothing lists once they are gone, to delete."""
        if self.retention is None:
            return [], []
        try:
            committed = sorted(self.ledger.committed().items())
            referenced = self.ledger.referenced_folders()
            held = self.held() if self.held is not None else set()
            keep = self.retention.keep(committed)
            doomed = [(step, m) for (step, m), kept in zip(committed, keep, strict=True)
                      if not kept and checkpoint_name(step) not in referenced and step not in held]
            for step, _ in doomed:
                if self.on_forget is not None:
                    self.on_forget(checkpoint_name(step))
            self.ledger.forget([step for step, _ in doomed])
            shared = self.let_go([m for _, m in doomed]) if self.let_go is not None else []
            return [checkpoint_name(step) for step, _ in doomed], shared
        except Exception as e:  # the commit stands; retention failing must not stop commits
            log.warning("mpckpt: retention after step %d failed: %s", step_done, e)
            return [], []


def _reason(error: BaseException | None) -> str:
    return "failed" if error is None else f"{type(error).__name__}: {str(error)[:500]}"


def _figures(record: Pending, waiting: int) -> dict[str, float | int | None]:
    """What the save cost, as known just before its manifest is written (``mpckpt stats``).

    persist_ms and durable_ms run to this moment (the ledger's figures also count the manifest's
    own write); ``waiting`` is how many later saves are taken and not yet durable now;
    blocked_ms is None while the caller is still inside ``save``: mode=SYNC waits for this commit.
    """
    stats = record.stats
    now = time.perf_counter()
    return {
        "blocked_ms": round(stats.blocked_ms, 3) if stats.blocked_ms > 0 else None,
        "snapshot_ms": round(stats.snapshot_ms, 3),
        "persist_ms": round((now - record.snapshot_done_at) * 1e3, 3),
        "bytes": stats.bytes,
        "written_bytes": stats.written_bytes,
        "durable_ms": round((now - stats.saved_at) * 1e3, 3),
        "waiting": waiting,
    }


def _saves(count: int, noun: str = "save") -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _run_quietly(work: Callable[[], Any], step: int, doing: str) -> None:
    """Work that follows a commit: its failure is logged and never stops the committer."""
    try:
        work()
    except (MpckptError, OSError) as e:
        log.warning("mpckpt: %s step %d: %s", doing, step, e)
    except Exception as e:  # a bug in a hook: the commit stands, later commits must go on
        log.error("mpckpt: %s step %d: %s: %s", doing, step, type(e).__name__, e, exc_info=e)
