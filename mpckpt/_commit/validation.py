"""Validation after commit (``validate=``): committed checkpoints waiting for their metrics.

As Ray Train's ``validate_fn``: after each commit, ``fn(checkpoint) -> {name: number}`` runs
outside the training process, and its metrics join the checkpoint's. The committer hands
each committed checkpoint over (``submit``, an after-commit step, so before retention runs);
the ``mpckpt-validator`` thread takes them in commit order, one at a time, and has the
validator process run ``fn`` (``validator_process``: started at the first validation, and
again after one died or ran past its deadline). Then:

* the metrics are written to ``validation.json`` beside the manifest (``format/validation.py``:
  a committed manifest is never replaced) and joined into the ledger's view of the checkpoint
  (``Ledger.update_committed``), so ``best()`` and ``KeepBest`` see them at once, and a scan
  (``mpckpt ls``, a reopened root, a read-only Checkpointer) finds them again;
* retention is applied again (``Committer.reapply_retention``): ``KeepBest`` now ranks it.

INVARIANT: retention never deletes a checkpoint that waits for its validation, is being
validated, or whose validation failed while this Checkpointer is open (``held``): ``KeepBest``
cannot rank a checkpoint before its metric exists, and a failed validation must never cost
the checkpoint. A Checkpointer that opens the root with ``validate=`` queues again every
checkpoint saved with ``validate=`` that has no validation metrics (a crash, a failure, a
close before it ran: ``resume``).

A failure (``fn`` raised, returned something other than numbers, ran past
``validate_timeout_s``, its process died, the metrics could not be stored) is a
``ValidationError`` naming the step and the cause: logged as a WARNING and kept in
``stats.validations``, never raised. Like all work after a commit (``committer.py``), it must
not stop training: the checkpoint is committed and restorable, only its evaluation is missing.

``wait`` (and so ``Checkpointer.wait`` and ``close``) returns once the queue is empty, bounded
by its timeout; ``close`` then gives up what is left (validated again at the next open).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from mpckpt._commit.validator_process import ValidationFailed, ValidatorProcess, ValidatorSetup, pickle_fn
from mpckpt._futures import ValidationStats
from mpckpt._ledger import Ledger
from mpckpt._threads import Thread
from mpckpt.errors import ConfigError, MpckptError, ValidationError, WaitTimeoutError
from mpckpt.format import validation as record
from mpckpt.format.manifest import Manifest
from mpckpt.format.names import checkpoint_name
from mpckpt.storage import Backend

log = logging.getLogger("mpckpt")


def prepare(validate: Any, backend: Backend) -> bytes | None:
    """``validate=`` as the bytes the validator process runs (None without one); ``ConfigError``
    now, before anything is started, if it cannot run there."""
    if validate is None:
        return None
    if getattr(backend, "process_local", False):
        raise ConfigError(f"validate= runs in a process of its own, which cannot see {backend.url}: that storage "
                          "lives only in this process; use a folder or a remote URL")
    return pickle_fn(validate)


class Validator:
    """The queue of committed steps to validate, and the thread that validates them in order."""

    def __init__(self, setup: ValidatorSetup, *, ledger: Ledger, backend: Backend, start_method: str,
                 timeout_s: float, stats: list[ValidationStats], after: Callable[[int], None]) -> None:
        self.setup, self.ledger, self.backend = setup, ledger, backend
        self.start_method, self.timeout_s = start_method, timeout_s
        self._stats, self._after = stats, after
        self._queue: collections.deque[int] = collections.deque()
        self._current: int | None = None  # being validated (held)
        self._busy = False                # validating, or applying retention after it (wait)
        self._failed: set[int] = set()   # held while this Checkpointer is open
        self._stopping = False
        self._abandon = False
        self._process: ValidatorProcess | None = None
        self._cond = threading.Condition()
        self._thread = Thread(target=self._run, name="mpckpt-validator", daemon=True)
        self._thread.start()

    # -- the committer's side ----------------------------------------------------------------
    def submit(self, step: int) -> None:
        """Validate committed ``step`` after those handed over before it."""
        with self._cond:
            if not self._stopping:
                self._queue.append(step)
                self._cond.notify_all()

    def resume(self, committed: Mapping[int, Manifest]) -> list[int]:
        """Queue the checkpoints saved with ``validate=`` that have no validation metrics; return them."""
        steps = sorted(s for s, m in committed.items() if m.validate and m.validation is None)
        for step in steps:
            self.submit(step)
        if steps:
            log.info("mpckpt: validating again the checkpoints of steps %s, saved with validate= and without "
                     "validation metrics", steps)
        return steps

    def in_flight(self) -> set[int]:
        """Steps queued or being validated now."""
        with self._cond:
            return {*self._queue, *(() if self._current is None else (self._current,))}

    def held(self) -> set[int]:
        """Steps retention must not delete: queued, being validated, or failed in this Checkpointer's life."""
        with self._cond:
            return {*self._queue, *self._failed, *(() if self._current is None else (self._current,))}

    # -- waiting and stopping ------------------------------------------------------------------
    def wait(self, *, timeout_s: float) -> None:
        """Block until every validation handed over so far has finished (or ``WaitTimeoutError``)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while (self._queue or self._busy) and not self._abandon:
                left = deadline - time.monotonic()
                if left <= 0:
                    steps = [*(() if self._current is None else (self._current,)), *self._queue]
                    raise WaitTimeoutError(f"validations of steps {steps[:5]} not finished within {timeout_s:.1f}s")
                self._cond.wait(min(left, 1.0))

    def close(self, *, timeout_s: float) -> None:
        """Stop now: what is still queued is not validated (the next open with ``validate=`` does it)."""
        with self._cond:
            self._stopping = self._abandon = True
            left = [*(() if self._current is None else (self._current,)), *self._queue]
            self._queue.clear()
            self._cond.notify_all()
        if left:
            log.warning("mpckpt: the Checkpointer of %s closed before the checkpoints of steps %s were validated; "
                        "opening it again with validate= validates them", self.backend.url, left)
        self._thread.join(timeout_s)
        process, self._process = self._process, None
        if process is not None:
            process.close()

    # -- the validator thread ------------------------------------------------------------------
    def _take(self) -> int | None:
        with self._cond:
            while not self._queue and not self._stopping:
                self._cond.wait()
            if self._abandon or not self._queue:
                return None
            self._current = self._queue.popleft()
            self._busy = True
            return self._current

    def _run(self) -> None:
        while (step := self._take()) is not None:
            stats = ValidationStats(step)
            self._stats.append(stats)
            started = time.monotonic()
            failed = False
            try:
                self._validate(step, stats)
            except ValidationFailed as e:
                failed = True
                error = ValidationError(f"step {step}: validation failed: {e}", step=step)
                error.__cause__ = e.__cause__ or e
                stats.status, stats.error = "failed", error
                log.warning("mpckpt: %s; the checkpoint is kept (never deleted while this Checkpointer is open)",
                            error)
            except Exception as e:  # a bug here: the checkpoint stands, later validations go on
                failed = True
                bug = ValidationError(f"step {step}: validation failed: {type(e).__name__}: {e}", step=step)
                bug.__cause__ = e
                stats.status, stats.error = "failed", bug
                log.error("mpckpt: validating step %d: %s: %s", step, type(e).__name__, e, exc_info=e)
            stats.seconds = time.monotonic() - started
            if stats.status == "ok":
                log.info("mpckpt: validated step %d in %.1f s: %s", step, stats.seconds, stats.metrics)
            with self._cond:
                if failed:
                    self._failed.add(step)
                self._current = None
            try:
                self._after(step)  # retention again, now that the step has its metrics (or failed)
            except Exception as e:
                log.warning("mpckpt: retention after validating step %d failed: %s", step, e)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _validate(self, step: int, stats: ValidationStats) -> None:
        manifest = self.ledger.committed().get(step)
        if manifest is None:
            stats.status = "skipped"
            log.info("mpckpt: step %d was deleted before its validation ran", step)
            return
        process = self._running_process()
        stats.pid = process.pid
        try:
            metrics = process.validate(step, checkpoint_name(step), manifest, timeout_s=self.timeout_s,
                                       abandoned=lambda: self._abandon)
        except ValidationFailed as e:
            if e.crashed:
                self._process = None  # the next validation starts a new one
                process.kill()
            raise
        name = checkpoint_name(step)
        if step not in self.ledger.committed():
            stats.status = "skipped"
            log.info("mpckpt: step %d was deleted while it was validated; its metrics %s are dropped", step, metrics)
            return
        try:
            self.backend.write_file(f"{name}/{record.VALIDATION_NAME}", [record.to_bytes(step, metrics)])
        except (MpckptError, OSError) as e:
            raise ValidationFailed(f"its metrics {metrics} could not be stored in {self.backend.url}: "
                                   f"{type(e).__name__}: {e}", cause=e) from e
        self.ledger.update_committed(step, lambda m: record.joined(m, metrics))
        stats.status, stats.metrics = "ok", metrics

    def _running_process(self) -> ValidatorProcess:
        process = self._process
        if process is not None and process.process.is_alive():
            return process
        if process is not None:  # died between validations
            process.kill()
        try:
            self._process = ValidatorProcess(self.setup, start_method=self.start_method)
        except Exception as e:
            raise ValidationFailed(f"the validator process could not start: {type(e).__name__}: {e}", cause=e) from e
        return self._process
