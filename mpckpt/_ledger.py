"""The sequencing ledger: sequence numbers and strictly in-order commits.

Every save gets the next sequence number when it is called. Its files may finish uploading
in any order relative to other saves, but the committer thread publishes checkpoints in
sequence order only: checkpoint N+1 is committed after N is committed, failed, skipped or
coalesced, never before. So ``latest`` only ever moves forward over committed checkpoints,
and a reader never sees step 20 while step 10, saved earlier, could still appear.

It starts from what ``catalog.recover`` found committed on storage.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mpckpt._futures import SaveFuture
from mpckpt.errors import (
    MpckptError,
    UploadError,
    WaitTimeoutError,
)
from mpckpt.format.manifest import (
    FileEntry,
    Manifest,
    checkpoint_name,
    checksum,
    format_version_for,
)
from mpckpt.storage import Backend

log = logging.getLogger("mpckpt")


@dataclass
class Pending:
    """One checkpoint between ``save`` and its commit."""

    seq: int
    step: int
    kind: str                                   # "state" or "directory"
    future: SaveFuture
    metrics: dict[str, Any] = field(default_factory=dict)
    staging: str | None = None
    files: dict[str, FileEntry] = field(default_factory=dict)
    # written by the committer; a callable is serialised there, off the training thread
    small_files: dict[str, bytes | Callable[[], bytes]] = field(default_factory=dict)
    jobs_left: int = 0
    submitted_all: bool = False
    outcome: str | None = None                  # persisted | failed | dropped
    error: BaseException | None = None
    snapshot_done_at: float = 0.0
    after_commit: list[Callable[[], None]] = field(default_factory=list)
    slabs: list[Any] = field(default_factory=list)  # shared memory this checkpoint still holds

    @property
    def name(self) -> str:
        return checkpoint_name(self.step)

    @property
    def settled(self) -> bool:
        """Nothing of it is still running: ready to commit, or to be failed or dropped."""
        if self.outcome is None:
            return False
        return self.outcome == "dropped" or (self.submitted_all and self.jobs_left == 0)


class Ledger:
    """In-order commits of the pending checkpoints of one checkpointer."""

    def __init__(self, backend: Backend, committed: dict[int, Manifest], *,
                 on_committed: Callable[[Pending, Manifest], Callable[[], None] | None] | None = None,
                 taken_steps: set[int] | None = None) -> None:
        self.backend = backend
        self.committed = dict(committed)
        self._pending: dict[int, Pending] = {}
        self._next_seq = max((m.seq for m in committed.values()), default=-1) + 1
        self._next_commit = self._next_seq
        self._cond = threading.Condition()
        self._stopping = False
        self._on_committed = on_committed
        # steps may only increase past everything on storage, damaged checkpoints included
        self.last_step: int | None = max([*committed, *(taken_steps or ())], default=None)
        self._thread = threading.Thread(target=self._run, name="mpckpt-committer", daemon=True)
        self._thread.start()

    @property
    def lock(self) -> threading.Condition:
        return self._cond

    # -- the training side ------------------------------------------------------------------
    def open(self, step: int, kind: str, future: SaveFuture, metrics: dict[str, Any]) -> Pending:
        with self._cond:
            record = Pending(self._next_seq, step, kind, future, dict(metrics))
            self._next_seq += 1
            self._pending[record.seq] = record
            self.last_step = step
            return record

    def latest_step(self) -> int | None:
        with self._cond:
            return max(self.committed, default=None)

    def pending(self) -> list[Pending]:
        with self._cond:
            return [self._pending[k] for k in sorted(self._pending)]

    # -- outcomes (any thread) ---------------------------------------------------------------
    def resolve(self, record: Pending, outcome: str, error: BaseException | None = None) -> None:
        """Mark ``record`` persisted, failed or dropped; the committer takes it from there."""
        with self._cond:
            if record.outcome is None or (outcome == "failed" and record.outcome == "persisted"):
                record.outcome = outcome
                record.error = error if record.error is None else record.error
            self._cond.notify_all()

    def file_done(self, record: Pending, relpath: str, entry: FileEntry) -> None:
        with self._cond:
            record.files[relpath] = entry
            record.jobs_left -= 1
            if record.jobs_left == 0 and record.submitted_all and record.outcome is None:
                record.outcome = "persisted"
            self._cond.notify_all()

    def file_failed(self, record: Pending) -> None:
        with self._cond:
            record.jobs_left -= 1
            self._cond.notify_all()

    def all_submitted(self, record: Pending) -> None:
        with self._cond:
            record.submitted_all = True
            if record.jobs_left == 0 and record.outcome is None:
                record.outcome = "persisted"
            self._cond.notify_all()

    def wait(self, records: list[Pending] | None = None, *, timeout_s: float) -> None:
        """Block until ``records`` (default: all pending) are finished, or raise WaitTimeoutError."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                waiting = [r for r in (records if records is not None else list(self._pending.values()))
                           if r.seq in self._pending]
                if not waiting:
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    steps = ", ".join(str(r.step) for r in waiting[:5])
                    raise WaitTimeoutError(f"checkpoints of steps {steps} not finished within {timeout_s:.0f}s")
                self._cond.wait(min(left, 1.0))

    def close(self, *, timeout_s: float = 30.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout_s)

    # -- the committer thread ------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    head = self._pending.get(self._next_commit)
                    if head is not None and head.settled:
                        break
                    if self._stopping and not self._pending:
                        return
                    if self._stopping and head is None and self._next_commit >= self._next_seq:
                        return
                    self._cond.wait(1.0)
            self._finish(head)
            with self._cond:
                del self._pending[head.seq]
                self._next_commit += 1
                self._cond.notify_all()

    def _finish(self, record: Pending) -> None:
        if record.outcome == "persisted":
            try:
                manifest = self._commit(record)
            except BaseException as e:
                record.outcome, record.error = "failed", e
            else:
                with self._cond:
                    self.committed[record.step] = manifest
                record.future.stats.status = "committed"
                record.future.stats.persist_ms = (time.perf_counter() - record.snapshot_done_at) * 1e3
                for fn in record.after_commit:
                    _run_quietly(fn, record)
                cleanup = None
                if self._on_committed is not None:
                    try:
                        cleanup = self._on_committed(record, manifest)
                    except Exception as e:  # the commit stands; retention failing must not stop commits
                        log.warning("mpckpt: retention after step %d failed: %s", record.step, e)
                record.future._resolve(record.name)
                if cleanup is not None:  # deletions run after the caller has its answer
                    _run_quietly(cleanup, record)
                return
        if record.outcome == "failed":
            if record.staging is not None:
                _run_quietly(lambda: self.backend.abort(record.staging), record)  # type: ignore[arg-type]
            error = record.error or UploadError(f"step {record.step}: checkpoint failed", step=record.step)
            if not isinstance(error, UploadError):
                wrapped = UploadError(f"step {record.step}: checkpoint not committed: {error}", step=record.step)
                wrapped.__cause__ = error
                error = wrapped
            record.future._fail(error)
            return
        record.future._resolve(None)  # dropped: skipped or coalesced, status set by the caller

    def _commit(self, record: Pending) -> Manifest:
        assert record.staging is not None
        files = dict(record.files)
        for rel, content in record.small_files.items():
            data = content() if callable(content) else content
            self.backend.write_file(f"{record.staging}/{rel}", [data])
            files[rel] = FileEntry(len(data), checksum(data))
        manifest = Manifest(step=record.step, seq=record.seq, kind=record.kind, files=files, metrics=record.metrics,
                            format_version=format_version_for(record.kind))
        # INVARIANT: every data file is durable before the manifest is written (commit does it last).
        self.backend.commit(record.staging, record.name, manifest.to_bytes())
        return manifest


def _run_quietly(fn: Callable[[], Any], record: Pending) -> None:
    """Run work that follows a commit; its failure is logged and never stops the committer."""
    try:
        fn()
    except (MpckptError, OSError) as e:
        log.warning("mpckpt: after committing step %d: %s", record.step, e)
    except Exception as e:  # a bug in a hook: the commit stands, later commits must go on
        log.error("mpckpt: after committing step %d: %s: %s", record.step, type(e).__name__, e, exc_info=e)

