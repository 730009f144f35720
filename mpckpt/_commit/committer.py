"""The committer thread: publishes settled checkpoints in save order, then does what follows.

For each record the ledger hands over (``Ledger.next_settled``, strictly in sequence order):

* persisted: write the small files (the skeleton), build the manifest, and let the
  coordinator publish it (``Coordinator.commit``: the manifest is written last), and log one
  INFO line (step, MiB written, blocked ms, persist ms, MB/s). Then, in
  this order: the record's after-commit work (what later saves may reference, deleting the
  user's local folder after an upload), the retention policy's decision (the doomed
  checkpoints are forgotten at once, so nothing lists or references them again), the
  caller's future, and last the deletion, handed to the ``Deleter`` so the next commit never
  waits for it;
* failed: abort its staging folder and fail its future with an ``UploadError`` naming the
  step and the cause;
* dropped (skipped or coalesced): resolve its future with no checkpoint.

INVARIANT: nothing after the commit can undo it or stop later commits: a failure in
after-commit work or retention is logged, and the next record is committed regardless.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mpckpt._commit.coordinator import Coordinator
from mpckpt._commit.deleter import Deleter
from mpckpt._commit.ledger import Ledger, Pending
from mpckpt.errors import MpckptError, UploadError, upload_error
from mpckpt.format.manifest import FileEntry, Manifest, checkpoint_name, checksum, format_version_for
from mpckpt.policies.retention import RetentionPolicy
from mpckpt.storage import Backend

log = logging.getLogger("mpckpt")


@dataclass(eq=False)
class Committer:
    """One thread that commits the ledger's records in order, with retention after each."""

    ledger: Ledger
    backend: Backend
    coordinator: Coordinator
    deleter: Deleter
    retention: RetentionPolicy | None = None
    on_forget: Callable[[str], None] | None = None  # a folder retention deletes: never reference it again
    _thread: threading.Thread = field(init=False)

    def __post_init__(self) -> None:
        self._thread = threading.Thread(target=self._run, name="mpckpt-committer", daemon=True)
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
        if record.outcome == "persisted":
            try:
                manifest = self._commit(record)
            except BaseException as e:
                self.ledger.mark_failed(record, e)
            else:
                self.ledger.mark_committed(record, manifest)
                stats = record.stats
                log.info("mpckpt: committed step %d to %s: %.1f MiB written, blocked %.1f ms, persisted in %.1f ms "
                         "(%.0f MB/s)", record.step, self.backend.url, stats.written_bytes / 2**20, stats.blocked_ms,
                         stats.persist_ms, stats.mb_per_s)
                for work in record.after_commit:
                    _run_quietly(work, record.step, "after committing")
                doomed = self._apply_retention(record)
                record.future._resolve(record.name)
                if doomed:  # deletions run after the caller has its answer
                    self.deleter.delete(doomed)
                return
        if record.outcome == "failed":
            _run_quietly(lambda: self.backend.abort(record.staging), record.step, "removing the failed attempt of")
            error = record.error
            if not isinstance(error, UploadError):
                error = upload_error(record.step, "checkpoint not committed", error)
            record.future._fail(error)
            return
        record.future._resolve(None)  # dropped: skipped or coalesced, status set by the caller

    def _commit(self, record: Pending) -> Manifest:
        files = dict(record.files)
        self.backend.prepare_staging(record.staging)  # made already unless no job wrote into it
        for rel, content in record.small_files.items():
            data = content() if callable(content) else content
            self.backend.write_file(f"{record.staging}/{rel}", [data])
            files[rel] = FileEntry(len(data), checksum(data))
        manifest = Manifest(step=record.step, seq=record.seq, kind=record.kind, files=files, metrics=record.metrics,
                            format_version=format_version_for(record.kind), world_size=self.coordinator.world_size,
                            figures=_figures(record))
        # INVARIANT: every data file is durable before the manifest is written (commit does it last).
        return self.coordinator.commit(record.staging, record.name, manifest)

    def _apply_retention(self, record: Pending) -> list[str]:
        """Forget the checkpoints the policy lets go of; return their folders to delete."""
        if self.retention is None:
            return []
        try:
            committed = sorted(self.ledger.committed().items())
            referenced = self.ledger.referenced_folders()
            keep = self.retention.keep(committed)
            doomed = [(step, checkpoint_name(step)) for (step, _), kept in zip(committed, keep, strict=True)
                      if not kept and checkpoint_name(step) not in referenced]
            for _, name in doomed:
                if self.on_forget is not None:
                    self.on_forget(name)
            self.ledger.forget([step for step, _ in doomed])
            return [name for _, name in doomed]
        except Exception as e:  # the commit stands; retention failing must not stop commits
            log.warning("mpckpt: retention after step %d failed: %s", record.step, e)
            return []


def _figures(record: Pending) -> dict[str, float | int | None]:
    """What the save cost, as known just before its manifest is written (``mpckpt stats``).

    persist_ms runs to this moment (the ledger's figure also counts the manifest's own write);
    blocked_ms is None while the caller is still inside ``save``: mode=SYNC waits for this commit.
    """
    stats = record.stats
    return {
        "blocked_ms": round(stats.blocked_ms, 3) if stats.blocked_ms > 0 else None,
        "snapshot_ms": round(stats.snapshot_ms, 3),
        "persist_ms": round((time.perf_counter() - record.snapshot_done_at) * 1e3, 3),
        "bytes": stats.bytes,
        "written_bytes": stats.written_bytes,
    }


def _run_quietly(work: Callable[[], Any], step: int, doing: str) -> None:
    """Work that follows a commit: its failure is logged and never stops the committer."""
    try:
        work()
    except (MpckptError, OSError) as e:
        log.warning("mpckpt: %s step %d: %s", doing, step, e)
    except Exception as e:  # a bug in a hook: the commit stands, later commits must go on
        log.error("mpckpt: %s step %d: %s: %s", doing, step, type(e).__name__, e, exc_info=e)
