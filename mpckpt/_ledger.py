"""The sequencing ledger: every checkpoint record, every change to it, and the commit order.

Every save and report gets the next sequence number when it is called, and a ``Pending``
record. The ledger is the only code that changes a record: jobs counted in and out, files
done or failed, slabs held, outcome, after-commit work; everyone else calls its methods,
which take its lock. Files may finish uploading in any order relative to other saves, but
``next_settled`` hands the committer the records in sequence order only: checkpoint N+1 is
committed after N is committed, failed, skipped or coalesced, never before. So ``latest``
only ever moves forward over committed checkpoints, and a reader never sees step 20 while
step 10, saved earlier, could still appear.

A record's life: ``recording()`` opens it (a ``save`` or ``report`` call) and settles it as
failed if the call raises; jobs are counted with ``add_jobs`` and come back through the
pool callback ``job_done``; ``all_submitted`` says no more jobs will come; once settled the
committer takes it (``next_settled``), commits or fails it, and ``retire`` removes it.

It starts from what ``catalog.recover`` found committed on storage.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from mpckpt._futures import SaveFuture, SaveStats
from mpckpt.errors import StepOrderError, WaitTimeoutError, upload_error
from mpckpt.format.manifest import FileEntry, Manifest, checkpoint_name

JobCallback = Callable[[Any, "dict[str, Any] | None", "BaseException | None"], None]


@dataclass
class Pending:
    """One checkpoint between ``save`` and its commit (changed only through the ``Ledger``)."""

    seq: int
    step: int
    kind: str                                   # "state" or "directory"
    future: SaveFuture
    staging: str                                # where its files are written until the commit
    metrics: dict[str, Any] = field(default_factory=dict)
    files: dict[str, FileEntry] = field(default_factory=dict)
    # files its jobs write into shared/ rather than its staging folder: manifest name -> path
    shared: dict[str, str] = field(default_factory=dict)
    # block checksums of files written with ``WriteJob.block_size`` (multi-rank): name -> digests
    blocks: dict[str, list[str]] = field(default_factory=dict)
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
    def stats(self) -> SaveStats:
        return self.future.stats

    @property
    def settled(self) -> bool:
        """Nothing of it is still running: ready to commit, or to be failed or dropped."""
        if self.outcome is None:
            return False
        return self.outcome == "dropped" or (self.submitted_all and self.jobs_left == 0)


class Ledger:
    """The records of one checkpointer, and their in-order hand-over to the committer."""

    def __init__(self, committed: dict[int, Manifest], *, staging_name: Callable[[str], str],
                 on_open: Callable[[Pending], None] | None = None, taken_steps: set[int] | None = None) -> None:
        self._committed = dict(committed)
        self._pending: dict[int, Pending] = {}
        self._next_seq = max((m.seq for m in committed.values()), default=-1) + 1
        self._next_commit = self._next_seq
        self._cond = threading.Condition()
        self._stopping = False
        self._staging_name = staging_name
        self._on_open = on_open
        # steps may only increase past everything on storage, damaged checkpoints included
        self._taken = set(taken_steps or ())
        self.last_step: int | None = max([*committed, *self._taken], default=None)

    # -- queries -------------------------------------------------------------------------------
    def latest_step(self) -> int | None:
        with self._cond:
            return max(self._committed, default=None)

    def committed(self) -> dict[int, Manifest]:
        """A copy of the committed checkpoints by step."""
        with self._cond:
            return dict(self._committed)

    def pending(self) -> list[Pending]:
        with self._cond:
            return [self._pending[k] for k in sorted(self._pending)]

    def waiting_after(self, record: Pending) -> int:
        """Saves taken after ``record`` that are still to become durable (neither failed nor
        dropped): what a crash would lose on top of ``record`` itself."""
        with self._cond:
            return self._waiting_after(record)

    def _waiting_after(self, record: Pending) -> int:
        return sum(1 for r in self._pending.values()
                   if r.seq > record.seq and r.outcome not in ("failed", "dropped") and r.stats.status == "pending")

    def referenced_folders(self) -> set[str]:
        """Folders whose files a committed or pending checkpoint references (never deleted)."""
        with self._cond:
            manifests = [m.files.values() for m in self._committed.values()]
            manifests += [dict(r.files).values() for r in self._pending.values()]
        return {e.ref for files in manifests for e in files if e.ref}

    def referenced_shared(self) -> set[str]:
        """Shared files a committed or pending checkpoint lists or is writing (never deleted)."""
        with self._cond:
            used = {p for m in self._committed.values() for p in m.shared_files()}
            for r in self._pending.values():
                used.update(r.shared.values())
                used.update(e.shared for e in r.files.values() if e.shared is not None)
        return used

    # -- opening and filling a record (the training thread) ----------------------------------------
    @contextlib.contextmanager
    def recording(self, step: int, kind: str, stats: SaveStats, metrics: dict[str, Any], *,
                  on_error: Callable[[Pending], None] | None = None) -> Iterator[Pending]:
        """One checkpoint's record, from the ``save``/``report`` call until its jobs are queued.

        ``save`` and ``report`` both go through here, so their records cannot drift apart. If
        the body raises, the record settles as failed (later commits are not held up) and the
        caller gets the error from this call, once: it is not raised again at the next save,
        wait or exit.
        """
        with self._cond:
            name = checkpoint_name(step)
            record = Pending(self._next_seq, step, kind, SaveFuture(stats), self._staging_name(name), dict(metrics))
            self._next_seq += 1
            self._pending[record.seq] = record
            self.last_step = step
        if self._on_open is not None:
            self._on_open(record)
        try:
            yield record
        except BaseException as e:
            if on_error is not None:
                on_error(record)
            self.resolve(record, "failed", e)
            self.all_submitted(record)
            record.future._mark_seen()
            raise

    def take_step(self, step: int) -> None:
        """Step ``step`` was saved or restored without a record here (kept in memory only): later
        saves must go past it."""
        with self._cond:
            self.last_step = step if self.last_step is None else max(self.last_step, step)

    def add_small_file(self, record: Pending, relpath: str, content: bytes | Callable[[], bytes]) -> None:
        """A file the committer writes just before the manifest (a callable runs there)."""
        with self._cond:
            record.small_files[relpath] = content

    def add_files(self, record: Pending, files: dict[str, FileEntry]) -> None:
        """Files already durable (referenced or adopted): no job writes them."""
        with self._cond:
            record.files.update(files)

    def add_shared(self, record: Pending, paths: dict[str, str]) -> None:
        """Files of ``record`` its jobs write to these paths in ``shared/`` (manifest name -> path)."""
        with self._cond:
            record.shared.update(paths)

    def add_jobs(self, record: Pending, count: int) -> None:
        with self._cond:
            record.jobs_left += count

    def after_commit(self, record: Pending, work: Callable[[], None]) -> None:
        """Run ``work`` on the committer once ``record`` is committed (never if it fails)."""
        with self._cond:
            record.after_commit.append(work)

    def hold(self, record: Pending, slab: Any) -> None:
        with self._cond:
            record.slabs.append(slab)

    def let_go(self, record: Pending, slab: Any) -> None:
        with self._cond:
            if slab in record.slabs:
                record.slabs.remove(slab)

    def holds(self, record: Pending, slab: Any) -> bool:
        with self._cond:
            return slab in record.slabs

    def all_submitted(self, record: Pending, *, snapshot_started: float | None = None) -> None:
        """No more jobs will be added to ``record``; its snapshot is done."""
        with self._cond:
            record.snapshot_done_at = time.perf_counter()
            if snapshot_started is not None:
                record.stats.snapshot_ms = (record.snapshot_done_at - snapshot_started) * 1e3
            record.submitted_all = True
            if record.jobs_left == 0 and record.outcome is None:
                record.outcome = "persisted"
            self._cond.notify_all()

    # -- outcomes (any thread) -----------------------------------------------------------------
    def resolve(self, record: Pending, outcome: str, error: BaseException | None = None) -> None:
        """Mark ``record`` persisted, failed or dropped; the committer takes it from there."""
        with self._cond:
            if record.outcome is None or (outcome == "failed" and record.outcome == "persisted"):
                record.outcome = outcome
                record.error = error if record.error is None else record.error
            self._cond.notify_all()

    def drop(self, record: Pending, status: str) -> list[Any]:
        """Drop ``record`` (coalesced): return the slabs it held, for the caller to release."""
        with self._cond:
            record.stats.status = status
            slabs, record.slabs = record.slabs, []
        self.resolve(record, "dropped")
        return slabs

    def job_done(self, record: Pending, doing: str, *,
                 then: Callable[[], None] | None = None) -> JobCallback:
        """The pool callback for one file of ``record``: record its entry, or the failure."""

        def done(job: Any, result: dict[str, Any] | None, error: BaseException | None) -> None:
            path = job.payload.relpath
            rel = next((k for k, v in record.shared.items() if v == path), path[len(record.staging) + 1:])
            with self._cond:
                record.jobs_left -= 1
                if error is not None:
                    failure = upload_error(record.step, f"{doing} {rel} failed", error, shard=rel)
                    if record.outcome in (None, "persisted"):
                        record.outcome = "failed"
                        record.error = record.error or failure
                else:
                    assert result is not None
                    record.files[rel] = FileEntry(result["size"], result["checksum"], shared=record.shared.get(rel))
                    if "blocks" in result:
                        record.blocks[rel] = result["blocks"]
                    if record.jobs_left == 0 and record.submitted_all and record.outcome is None:
                        record.outcome = "persisted"
                self._cond.notify_all()
            if then is not None:
                then()

        return done

    # -- the committer's side ------------------------------------------------------------------
    def next_settled(self) -> Pending | None:
        """The next record in sequence order once it has settled; None once stopped and empty."""
        with self._cond:
            while True:
                head = self._pending.get(self._next_commit)
                if head is not None and head.settled:
                    return head
                if self._stopping and (not self._pending or head is None and self._next_commit >= self._next_seq):
                    return None
                self._cond.wait(1.0)

    def mark_committed(self, record: Pending, manifest: Manifest) -> None:
        with self._cond:
            self._committed[record.step] = manifest
            now = time.perf_counter()
            record.stats.status = "committed"
            record.stats.persist_ms = (now - record.snapshot_done_at) * 1e3
            record.stats.durable_ms = (now - record.stats.saved_at) * 1e3
            record.stats.waiting = self._waiting_after(record)

    def update_committed(self, step: int, change: Callable[[Manifest], Manifest]) -> bool:
        """Replace committed ``step``'s manifest by ``change(manifest)`` in this view (validation
        metrics joined; storage is not touched). False if ``step`` is no longer committed."""
        with self._cond:
            manifest = self._committed.get(step)
            if manifest is None:
                return False
            self._committed[step] = change(manifest)
            return True

    def mark_failed(self, record: Pending, error: BaseException) -> None:
        with self._cond:
            record.outcome, record.error = "failed", error

    def forget(self, steps: list[int]) -> None:
        """Retention is deleting these committed checkpoints: they are no longer listed."""
        with self._cond:
            for step in steps:
                self._committed.pop(step, None)

    def set_aside(self, steps: list[int]) -> None:
        """These damaged checkpoints were moved out of the way (``Runtime.set_aside``): no longer
        listed, and their steps may be saved again. Refused while anything is pending."""
        with self._cond:
            if self._pending:
                raise StepOrderError(f"checkpoints are still being saved; wait() for them before setting the damaged "
                                     f"checkpoints of steps {sorted(steps)} aside")
            for step in steps:
                self._committed.pop(step, None)
                self._taken.discard(step)
            self.last_step = max([*self._committed, *self._taken], default=None)

    def discard_after(self, step: int) -> list[int]:
        """Forget every committed checkpoint newer than ``step`` (a run goes on from it); return them.

        Steps may then go on from ``step + 1``. Refused while anything is pending, or when a
        damaged checkpoint newer than ``step`` is in the way (damaged ones are never deleted).
        """
        with self._cond:
            if self._pending:
                raise StepOrderError("checkpoints are still being saved; wait() for them before going back to "
                                     f"step {step}")
            damaged = sorted(s for s in self._taken if s > step)
            if damaged:
                raise StepOrderError(f"damaged checkpoints of steps {damaged} are newer than step {step} and are "
                                     "never deleted by mpckpt; look at them (mpckpt verify), remove them by hand, "
                                     "or save the new branch into another root")
            newer = sorted(s for s in self._committed if s > step)
            for s in newer:
                del self._committed[s]
            self.last_step = max([*self._committed, *self._taken], default=None)
            return newer

    def retire(self, record: Pending) -> None:
        """``record`` is finished: the next one in sequence may be handed over."""
        with self._cond:
            del self._pending[record.seq]
            self._next_commit += 1
            self._cond.notify_all()

    def stop(self) -> None:
        """``next_settled`` returns None once everything pending has been handed over."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    # -- waiting -------------------------------------------------------------------------------
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
