"""``Checkpointer``: the context manager a training loop holds.

Opening it checks the root, takes the single-writer lock, removes what a crashed run left
(staging folders, manifest-less checkpoint folders, orphaned shared memory), reads the
committed checkpoints, and starts and warms the uploader processes. ``save`` then does, in
the caller's thread: flatten the state (bad input fails here, before anything is written),
take a slab from the budget, copy into it, queue one write job per shard, return a future.
The uploaders write; the ledger commits in save order; leaving the block waits for all of
it and raises what failed.

Errors from the background surface exactly once: on the future if the caller looks there,
otherwise at the next ``save``, ``report``, ``wait`` or exit, naming the step and the cause.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import shutil
import socket
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from mpckpt._copier import estimate_state_bytes
from mpckpt._futures import CheckpointerStats, SaveFuture, SaveStats
from mpckpt._ledger import Pending
from mpckpt._runtime import Runtime, caller_location, finalizer_for
from mpckpt._saving import skeleton_bytes
from mpckpt._snapshot import flatten
from mpckpt.catalog import Catalog, load  # noqa: F401 -- load: mpckpt.load, kept importable here
from mpckpt.checkpoint import Checkpoint, local_files
from mpckpt.config import BudgetPolicy, Config, UploadMode
from mpckpt.errors import (
    ConfigError,
    CorruptCheckpointError,
    MpckptError,
    StepOrderError,
    add_note,
)
from mpckpt.format.manifest import SKELETON_NAME, checkpoint_name
from mpckpt.restore import apply_state, load_checkpoint
from mpckpt.storage import open_backend, spec_for_url

log = logging.getLogger("mpckpt")


class Checkpointer:
    """Asynchronous checkpoints of a training state into ``root`` (a path or URL)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        memory_budget: int | str | float | None = None,
        workers: int | None = None,
        policy: str | BudgetPolicy | None = None,
        overlap: bool | None = None,
        keep_last: int | None = None,
        allow_pickle: bool = False,
        timeout_s: float | None = None,
        job_timeout_s: float | None = None,
        storage_options: Mapping[str, Any] | None = None,
        start_method: str | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.config = Config.resolve(
            memory_budget=memory_budget, workers=workers, policy=policy, overlap=overlap,
            allow_pickle=allow_pickle, keep_last=keep_last, timeout_s=timeout_s, job_timeout_s=job_timeout_s,
            start_method=start_method, environ=environ,
        )
        self._spec = spec_for_url(root, dict(storage_options or {}))
        self.backend = open_backend(self._spec)
        self.backend.check_writable()
        self._check_shm()
        # Everything the Checkpointer holds lives in the runtime, which never refers back to
        # it: so an unclosed Checkpointer that nobody references can be finalized.
        self._rt = Runtime(self.config, self._spec, self.backend, environ=dict(os.environ),
                           owner=f"pid {os.getpid()} on {socket.gethostname()}", where=caller_location(),
                           pin=_cuda_available())
        self._finalizer = finalizer_for(self, self._rt)
        self.pool, self.arena, self.ledger, self._saver = self._rt.pool, self._rt.arena, self._rt.ledger, self._rt.saver
        self._damaged = self._rt.damaged
        self.reported: list[dict[str, Any]] = []

    @property
    def stats(self) -> CheckpointerStats:
        """Figures of every save and report, and the uploaders' restart and retry counters."""
        return self._rt.stats

    @property
    def _closed(self) -> bool:
        return getattr(self, "_rt", None) is None or self._rt.closed

    @property
    def url(self) -> str:
        return self.backend.url

    def _check_shm(self) -> None:
        free = _shm_free()
        if free is not None and free < min(self.config.memory_budget_bytes, 64 << 20):
            raise ConfigError(
                f"/dev/shm has only {free >> 20} MiB free, below the memory budget; enlarge it "
                "(docker: --shm-size=8g) or lower memory_budget / MPCKPT_MEMORY_BUDGET"
            )
        if free is not None and free < self.config.memory_budget_bytes:
            warnings.warn(
                f"mpckpt: /dev/shm has {free >> 20} MiB free, less than the memory budget "
                f"({self.config.memory_budget_bytes >> 20} MiB); saves will stream through what is there",
                stacklevel=3,
            )
            self.config = dataclasses.replace(self.config, memory_budget_bytes=int(free * 0.9))

    # -- context manager ----------------------------------------------------------------------
    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except BaseException as e:  # keep the body's exception; mention ours on it
            add_note(exc, f"mpckpt: while closing after this error: {type(e).__name__}: {e}")

    def close(self) -> None:
        """Wait for every pending upload, stop the uploaders, free shared memory; raise failures.

        A Checkpointer that is dropped unclosed is closed by its finalizer (or at exit), which
        logs what failed instead of raising it.
        """
        if self._closed:
            return
        self._finalizer.detach()
        self._rt.close()

    # -- saving ---------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        state: Any,
        *,
        metrics: Mapping[str, Any] | None = None,
        mode: UploadMode | str = UploadMode.ASYNC,
        overlap: bool | None = None,
    ) -> SaveFuture:
        """Snapshot ``state`` for ``step``; return once copied (ASYNC) or committed (SYNC).

        With ``overlap`` (default: the checkpointer's setting) the copy of parameters and
        optimizer state runs in the background until the next ``optimizer.step()``.
        """
        started = time.perf_counter()
        # A save allocates an object or two per tensor and creates no cycles: a collection
        # triggered in here would scan every live tensor on the training thread's time.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            return self._save(started, step, state, metrics=metrics, mode=mode, overlap=overlap)
        finally:
            if gc_was_enabled:
                gc.enable()

    def _save(self, started: float, step: int, state: Any, *, metrics: Mapping[str, Any] | None,
              mode: UploadMode | str, overlap: bool | None) -> SaveFuture:
        self._check_usable()
        self.snapshot_barrier()
        mode = _mode(mode)
        if mode is UploadMode.NO_UPLOAD:
            raise ConfigError("mode=NO_UPLOAD registers files already stored; use it with report(checkpoint=...)")
        step = self._check_step(step)
        metrics = _check_metrics(metrics)
        flat = flatten(state, allow_pickle=self.config.allow_pickle)
        layout = self._saver.layout_for(flat)
        stats = SaveStats(step, bytes=flat.nbytes)
        first = self._saver.take_slab(layout) if layout.waves else None
        if layout.waves and first is None:
            stats.status = "skipped"
            warnings.warn(f"mpckpt: memory budget full, checkpoint of step {step} skipped (policy 'skip')",
                          stacklevel=2)
            return self._returned(self._untracked(stats), UploadMode.ASYNC, started)

        def release_first(record: Pending) -> None:  # unless a wave job or the background copy owns it
            if first is not None and first not in record.slabs:
                self.arena.release(first)

        with self._record(step, "state", stats, metrics, on_error=release_first) as record:
            record.small_files[SKELETON_NAME] = lambda: skeleton_bytes(flat, layout)
            reuse = self._saver.reuse_unchanged(record, flat, layout)
            stats.written_bytes = sum(len(s.header) + s.nbytes for w in layout.waves for s in w.shards
                                      if s.filename not in reuse.files)
            overlap = self.config.overlap if overlap is None else bool(overlap)
            if overlap and len(layout.waves) == 1 and mode is UploadMode.ASYNC:
                self._saver.snapshot_overlapped(record, state, flat, layout, first, reuse)
            else:
                self._saver.snapshot_eager(record, flat, layout, first, reuse)
        return self._returned(record.future, mode, started)

    # -- the life of one save's or report's record ------------------------------------------------
    def _untracked(self, stats: SaveStats) -> SaveFuture:
        future = SaveFuture(stats)
        self.stats.saves.append(stats)
        future._resolve(None)
        return future

    @contextlib.contextmanager
    def _record(self, step: int, kind: str, stats: SaveStats, metrics: dict[str, Any], *,
                on_error: Callable[[Pending], None] | None = None) -> Iterator[Pending]:
        """One checkpoint's record, staged, from ``save``/``report`` until its jobs are queued.

        ``save`` and ``report`` both go through here, so their records cannot drift apart. If
        the body raises, the record settles as failed (later commits are not held up) and the
        caller gets the error from this call, once: it is not raised again at the next save,
        wait or exit.
        """
        future = SaveFuture(stats)
        self.stats.saves.append(stats)
        record = self.ledger.open(step, kind, future, metrics)
        self._rt.futures.append(future)
        try:
            record.staging = self.backend.stage(record.name)
            yield record
        except BaseException as e:
            if on_error is not None:
                on_error(record)
            self.ledger.resolve(record, "failed", e)
            self.ledger.all_submitted(record)
            future._mark_seen()
            raise

    def _returned(self, future: SaveFuture, mode: UploadMode, started: float) -> SaveFuture:
        """Wait for the commit unless ASYNC; record how long the caller was blocked."""
        if mode is not UploadMode.ASYNC:
            future.result(self.config.timeout_s)
        future.stats.blocked_ms = (time.perf_counter() - started) * 1e3
        return future

    def snapshot_barrier(self) -> None:
        """Wait until an overlapped snapshot has finished copying.

        ``optimizer.step()`` calls this for you; call it before any other in-place change of
        parameters or optimizer state (an EMA update, a manual weight edit).
        """
        if not self._closed:
            self._saver.barrier()

    def report(
        self,
        metrics: Mapping[str, Any] | None = None,
        checkpoint: Checkpoint | None = None,
        *,
        step: int | None = None,
        mode: UploadMode | str = UploadMode.ASYNC,
        delete_local_after_upload: bool | None = None,
    ) -> SaveFuture | None:
        """Record metrics and, with ``checkpoint``, upload and commit a folder the user wrote.

        By default the local folder is deleted after an ASYNC upload and kept after a SYNC one.
        ``NO_UPLOAD`` commits a folder that is already on the checkpoint filesystem by moving it
        into place (local roots only).
        """
        started = time.perf_counter()
        self._check_usable()
        mode = _mode(mode)
        metrics = _check_metrics(metrics)
        if step is None:
            step = int(metrics["step"]) if "step" in metrics else (
                0 if self.ledger.last_step is None else self.ledger.last_step + 1)
        if checkpoint is None:
            self.reported.append({"step": step, **metrics})
            return None
        if not isinstance(checkpoint, Checkpoint) or checkpoint._stored is not None:
            raise ConfigError("report(checkpoint=...) takes Checkpoint.from_directory(path) of files you wrote")
        step = self._check_step(step)
        files = local_files(checkpoint.path, links=mode is not UploadMode.NO_UPLOAD)
        if delete_local_after_upload is None:
            delete_local_after_upload = mode is UploadMode.ASYNC
        if mode is UploadMode.NO_UPLOAD and self._spec.scheme != "file":
            raise ConfigError(f"mode=NO_UPLOAD moves a local folder into {self.url}; with a remote root use ASYNC or SYNC")
        stats = SaveStats(step, bytes=sum(os.path.getsize(os.path.join(checkpoint.path, f)) for f in files))
        with self._record(step, "directory", stats, metrics) as record:
            if mode is UploadMode.NO_UPLOAD:
                self._saver.adopt_directory(record, checkpoint.path, files)
            else:
                self._saver.submit_upload(record, checkpoint.path, files)
                if delete_local_after_upload:
                    record.after_commit.append(lambda: shutil.rmtree(checkpoint.path))
            record.snapshot_done_at = time.perf_counter()
            stats.written_bytes = stats.bytes
            self.ledger.all_submitted(record)
        return self._returned(record.future, mode, started)

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until every pending checkpoint is committed or failed; raise unseen failures."""
        if self._closed:
            return
        self.snapshot_barrier()
        self.ledger.wait(timeout_s=self.config.timeout_s if timeout_s is None else timeout_s)
        self._raise_unseen()

    def _check_usable(self) -> None:
        if self._closed:
            raise MpckptError("this Checkpointer is closed; open a new one")
        self._raise_unseen()

    def _raise_unseen(self) -> None:
        self._rt.raise_unseen()

    def _check_step(self, step: Any) -> int:
        if isinstance(step, bool) or not isinstance(step, int) and not hasattr(step, "__index__"):
            raise ConfigError(f"step={step!r} must be an int")
        step = int(step)
        if step < 0:
            raise ConfigError(f"step={step} must not be negative")
        last = self.ledger.last_step
        if last is not None and step <= last:
            raise StepOrderError(
                f"step {step} is not after the last saved step {last}; steps must increase "
                "(committed checkpoints are never overwritten)"
            )
        return step

    # -- warming ----------------------------------------------------------------------------------
    def prepare(self, state: Any) -> int:
        """Create and touch shared memory for ``state`` now (as its first save would need).

        ``restore`` calls this for you. Returns the bytes reserved.
        """
        self._check_usable()
        flat = flatten(state, allow_pickle=self.config.allow_pickle)
        need = estimate_state_bytes(state, flat)
        need = min(int(need * 1.02) + (4 << 20), self.config.memory_budget_bytes)
        # two slabs: the first save's, and the spare the next save uses while it uploads
        self.arena.reserve(need, count=2)
        return need

    # -- reading ----------------------------------------------------------------------------------
    @property
    def latest_step(self) -> int | None:
        """The newest committed step (never moves past an uncommitted one)."""
        return self.ledger.latest_step()

    def _catalog(self) -> Catalog:
        with self.ledger.lock:
            return Catalog(self.ledger.committed)

    def steps(self) -> list[int]:
        """Committed steps, oldest first."""
        return self._catalog().steps()

    def best(self, n: int = 1, metric: str = "loss", mode: str = "min") -> list[int]:
        """The ``n`` committed steps with the best ``metric`` (``mode`` 'min' or 'max'; NaN never wins)."""
        return self._catalog().best(n, metric, mode)

    def checkpoint(self, step: int | None = None) -> Checkpoint:
        """The committed checkpoint of ``step`` (default: the latest) as a ``Checkpoint``."""
        manifest = self._catalog().manifest(step, self.url)
        name = checkpoint_name(manifest.step)
        return Checkpoint(f"{self.url}/{name}", _stored=(self.backend, name, manifest))

    def load(self, step: int | None = None) -> Any:
        """The plain nested state of a committed checkpoint (default: the latest)."""
        ckpt = self.checkpoint(step)
        assert ckpt._stored is not None
        backend, name, manifest = ckpt._stored
        return load_checkpoint(backend, name, manifest, allow_pickle=self.config.allow_pickle)

    def restore(self, state: Any, *, step: int | None = None, fallback: bool = False) -> int | None:
        """Load the latest committed checkpoint (or ``step``) into ``state`` in place.

        Returns the restored step, or None when there is no checkpoint yet. With ``fallback``,
        a checkpoint that does not verify is skipped for the newest older one that does.
        Also warms shared memory for saving ``state``.
        """
        self._check_usable()
        candidates = [step] if step is not None else sorted({*self.steps(), *self._damaged}, reverse=True)
        restored = None
        for candidate in candidates:
            try:
                if candidate in self._damaged:
                    raise self._damaged[candidate]
                loaded = self.load(candidate)
            except CorruptCheckpointError as e:
                if not fallback or step is not None:
                    raise
                log.warning("mpckpt: step %s does not verify, trying an older one: %s", candidate, e)
                continue
            apply_state(state, loaded)
            restored = candidate
            break
        else:
            if candidates and fallback:
                raise CorruptCheckpointError(f"no checkpoint in {self.url} verifies")
        self.prepare(state)
        return restored


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


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _shm_free() -> int | None:
    from mpckpt.config import shm_free_bytes

    return shm_free_bytes()
