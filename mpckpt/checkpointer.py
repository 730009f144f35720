"""``Checkpointer``: the context manager a training loop holds; the public face of the pipeline.

It validates what the caller passes (steps, metrics, modes), holds the public API, and
delegates everything else to the ``Runtime`` it opens, which never refers back to it:

    open    -> _opening.open_root (read-only or writing, one process or a job: what may open)
               -> _runtime.Runtime, or _runtime.StorageView when read-only
    save    -> Runtime.save (due, preempted, warming) -> _stage.saving.Snapshotter (layout, budget,
               reuse, copy) -> _upload.pool
    report  -> Runtime.report (the folder's rules) -> _upload.directory.DirectoryUploads -> _upload.pool
            -> _commit.ledger (records, order) -> _commit.committer (coordinator, retention, deleter)
    queries -> catalog.Catalog over the ledger's committed checkpoints
    errors  -> _commit.sink.ErrorSink

Opening it checks the root, takes the single-writer lock, removes what a crashed run left
(``catalog.recover``), and starts and warms the uploader processes. ``save`` returns once the
state is copied (ASYNC) or committed (SYNC); leaving the block waits for all of it and
raises what failed.

``read_only=True`` opens none of that (``_runtime.StorageView``): it lists and restores while
another process writes. ``preemption=`` installs signal handlers (``_preemption``) that make
the next ``save`` a due, synchronous one. ``validate=`` runs a function on each committed
checkpoint in a process of its own (``_commit.validation``); its metrics join the
checkpoint's, and its failures are logged, never raised (the checkpoint stays).

Errors from the background surface exactly once: on the future if the caller looks there,
otherwise at the next ``save``, ``report``, ``wait`` or exit, naming the step and the cause.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from mpckpt._apply import apply_state, init_optimizer_state
from mpckpt._dist.reading import load_ranked_for, shard_like_live
from mpckpt._futures import CheckpointerStats, SaveFuture
from mpckpt._opening import open_root
from mpckpt._runtime import Runtime, StorageView
from mpckpt._stage.snapshot import flatten
from mpckpt.catalog import Catalog, load, load_newest  # noqa: F401 -- load: mpckpt.load, kept importable here
from mpckpt.checkpoint import Checkpoint
from mpckpt.config import BudgetPolicy, Config, UploadMode
from mpckpt.errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    MpckptError,
    RankError,
    StateError,
    StepOrderError,
    add_note,
)
from mpckpt.format.manifest import checkpoint_name
from mpckpt.policies.retention import RetentionPolicy
from mpckpt.policies.triggers import Trigger
from mpckpt.restore import load_checkpoint, verify_checkpoint

log = logging.getLogger("mpckpt")
_VERIFY_OLDER = 3  # older checkpoints read to say which one is intact, when the newest does not verify


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
        keep: RetentionPolicy | None = None,
        trigger: Trigger | None = None,
        allow_pickle: bool = False,
        timeout_s: float | None = None,
        job_timeout_s: float | None = None,
        storage_options: Mapping[str, Any] | None = None,
        start_method: str | None = None,
        environ: Mapping[str, str] | None = None,
        preemption: bool | Sequence[int | str] = False,
        validate: Callable[[Checkpoint], Mapping[str, float]] | None = None,
        validate_timeout_s: float | None = None,
        read_only: bool = False,
        process_group: Any = None,
        uploader_priority: str | None = None,
    ) -> None:
        self.config = Config.resolve(
            memory_budget=memory_budget, workers=workers, policy=policy, overlap=overlap,
            allow_pickle=allow_pickle, keep_last=keep_last, keep=keep, trigger=trigger, timeout_s=timeout_s, job_timeout_s=job_timeout_s,
            start_method=start_method, validate=validate, validate_timeout_s=validate_timeout_s, environ=environ,
            uploader_priority=uploader_priority,
        )
        opened = open_root(self, root, self.config, storage_options=storage_options, preemption=preemption,
                           read_only=read_only, process_group=process_group, keep=keep, keep_last=keep_last,
                           trigger=trigger, validate=validate)
        self.config, self._spec = opened.config, opened.spec  # writing: the budget fitted to /dev/shm
        # the runtime never refers back to this Checkpointer: an unclosed one nobody holds is finalized
        self._rt: Runtime | StorageView = opened.runtime
        self._finalizer = opened.finalizer

    @property
    def _warmed(self) -> bool:
        """Shared memory was made ahead for the first save (``prepare``, or a save not due yet)."""
        return isinstance(self._rt, Runtime) and self._rt.warmed

    @property
    def stats(self) -> CheckpointerStats:
        """Figures of every save and report, and the uploaders' restart and retry counters."""
        return self._rt.stats

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

    def _writer(self) -> Runtime:
        """The runtime of a Checkpointer that may write (a clear error for a read-only one)."""
        self._check_usable()
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
        if self._finalizer is not None:
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
        force: bool = False,
    ) -> SaveFuture | None:
        """Snapshot ``state`` for ``step``; return once copied (ASYNC) or committed (SYNC).

        With a ``trigger``, a step that is not due returns None at once (nothing copied);
        ``force`` saves regardless. With ``overlap`` (default: the checkpointer's setting) the
        copy of parameters and optimizer state runs in the background until the next
        ``optimizer.step()``. After a preemption signal (``preemption=``) every save is due and
        returns after its commit.
        """
        started = time.perf_counter()
        rt = self._writer()
        mode = _mode(mode)
        if mode is UploadMode.NO_UPLOAD:
            raise ConfigError("mode=NO_UPLOAD registers files already stored; use it with report(checkpoint=...)")
        step = self._check_step(step)
        return rt.save(step, state, _check_metrics(metrics), mode=mode, overlap=overlap, force=force, started=started)

    def should_save(self, step: int) -> bool:
        """Whether ``save(step, ...)`` would save now (always True without a ``trigger``, and after a
        preemption signal)."""
        return self._writer().should_save(step, self._check_int)

    def snapshot_barrier(self) -> None:
        """Wait until an overlapped snapshot has finished copying.

        ``optimizer.step()`` calls this for you; call it before any other in-place change of
        parameters or optimizer state (an EMA update, a manual weight edit).
        """
        if not self._closed and isinstance(self._rt, Runtime):
            self._rt.saver.barrier()

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
        rt = self._writer()
        mode = _mode(mode)
        return rt.report(step, _check_metrics(metrics), checkpoint, mode=mode, delete_local=delete_local_after_upload,
                         started=started, check_step=self._check_step)

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until every pending checkpoint is committed or failed, and every pending
        validation (``validate=``) has finished; raise unseen upload failures.

        By default the wait is bounded by ``timeout_s`` (in a multi-rank job: twice that and
        ten seconds, so that a dead rank is reported by name, as a ``RankError``)."""
        if self._closed:
            return
        self._rt.wait(self._rt.wait_s if timeout_s is None else timeout_s)
        self._rt.errors.raise_unseen()

    def delete(self, *steps: int, damaged: bool = False) -> None:
        """Delete the checkpoints of ``steps`` now, whatever the retention policy says.

        Every other checkpoint stays loadable: the shared files a deleted checkpoint used
        (frozen shards) are deleted only when no committed or pending checkpoint lists them.
        The newest one may be deleted too (``latest_step`` then goes back), but not while saves
        are pending (``StepOrderError``: ``wait()`` first); its step is not saved again (steps
        only increase). Refused as a whole, before anything is deleted: a step that is not
        there (``CheckpointNotFoundError``), a damaged one unless ``damaged=True`` (kept
        otherwise, since it may be recoverable), and a folder that a checkpoint written by an
        mpckpt before shared files reads files from, unless that one is deleted with it
        (``ConfigError``), one whose validation (``validate=``) is queued or running
        (``StepOrderError``). The folder's manifest goes first, so a reader never finds it half deleted.
        """
        self._check_usable()
        if not steps:
            raise ConfigError("delete() needs the steps of the checkpoints to delete")
        if self._writer().group is not None:
            raise ConfigError("delete() is not available in a multi-rank job (every rank would have to agree); let "
                              "retention (keep=) delete, or use `mpckpt rm ROOT STEP` once the job has stopped")
        self._writer().delete([self._check_int(s) for s in steps], damaged=damaged)

    def discard_newer(self, step: int) -> list[int]:
        """Delete the committed checkpoints newer than ``step``, so that saving goes on from there.

        What ``restore(state, step=N, discard_newer=True)`` does after its restore, for a run that
        got to ``step`` another way (a framework's own resume; ``0``: a fresh start). Returns the
        deleted steps. Waits for pending saves first; refused when a damaged checkpoint newer than
        ``step`` is in the way (``StepOrderError``) and in a multi-rank job (``ConfigError``).
        """
        self._check_usable()
        step = self._check_int(step)
        if self._writer().group is not None:
            raise ConfigError("discard_newer() is not available in a multi-rank job; delete the newer checkpoints "
                              "with `mpckpt rm` before the job starts")
        return self._writer().discard_after(step)

    def forget_deleted(self) -> list[int]:
        """Stop listing the committed checkpoints that someone else deleted (a framework's own
        retention, such as Ray Train's ``num_to_keep``, or ``mpckpt rm``): each listed step whose
        manifest is gone from storage, except the newest. Returns the steps no longer listed."""
        return self._writer().forget_deleted()

    def _check_usable(self) -> None:
        if self._closed:
            raise MpckptError("this Checkpointer is closed; open a new one")
        self._rt.errors.raise_unseen()

    @staticmethod
    def _check_int(step: Any) -> int:
        if isinstance(step, bool) or not isinstance(step, int) and not hasattr(step, "__index__"):
            raise ConfigError(f"step={step!r} must be an int")
        step = int(step)
        if step < 0:
            raise ConfigError(f"step={step} must not be negative")
        return step

    def _check_step(self, step: Any) -> int:
        step = self._check_int(step)
        last = self._writer().ledger.last_step
        if last is not None and step <= last:
            raise StepOrderError(
                f"step {step} is not after the last saved step {last}; steps must increase "
                "(committed checkpoints are never overwritten). To go on from an earlier checkpoint, restore it "
                "with restore(state, step=N, discard_newer=True), which deletes the newer ones; to keep them, "
                "save the new branch into another root"
            )
        return step

    # -- warming ----------------------------------------------------------------------------------
    def prepare(self, state: Any) -> int:
        """Create and touch shared memory for ``state`` now (as its first save would need).

        ``restore`` calls this for you. Returns the bytes reserved. In a multi-rank job it
        reserves what this rank writes (its shards, its share of the replicated tensors), which
        the first call for a state shape agrees with the other ranks: every rank calls it.
        """
        return self._writer().prepare(state)

    # -- reading ----------------------------------------------------------------------------------
    @property
    def latest_step(self) -> int | None:
        """The newest committed step (never moves past an uncommitted one)."""
        return self._rt.latest_step()

    def _catalog(self) -> Catalog:
        return Catalog(self._rt.committed())

    def steps(self) -> list[int]:
        """Committed steps, oldest first."""
        return self._catalog().steps()

    def best(self, n: int = 1, metric: str = "loss", mode: str = "min") -> list[int]:
        """The ``n`` committed steps with the best ``metric`` (``mode`` 'min' or 'max'; NaN never wins)."""
        return self._catalog().best(n, metric, mode)

    def checkpoint(self, step: int | None = None) -> Checkpoint:
        """The committed checkpoint of ``step`` (default: the latest) as a ``Checkpoint``."""
        manifest = self._catalog().manifest(step, self.url)
        if isinstance(self._rt, Runtime):
            manifest = self._rt.complete(manifest)  # (a rank other than 0 learns only a summary)
        name = checkpoint_name(manifest.step)
        return Checkpoint(f"{self.url}/{name}", _stored=(self._rt.backend, name, manifest))

    def load(self, step: int | None = None, *, classes: bool = True) -> Any:
        """The plain nested state of a committed checkpoint (default: the latest).

        ``classes=False``: namedtuples and dataclasses as dicts, Enum members as names (see ``mpckpt.load``).
        While it reads, this Checkpointer's retention keeps that checkpoint.
        """
        with self._reading(step if step is not None else self.latest_step) as (backend, name, manifest):
            return load_checkpoint(backend, name, manifest, allow_pickle=self.config.allow_pickle, classes=classes)

    @contextlib.contextmanager
    def _reading(self, step: int | None) -> Iterator[tuple[Any, str, Any]]:
        """(backend, folder name, manifest) of committed ``step``, kept from retention while in use."""
        reading = self._rt.reading(step) if isinstance(self._rt, Runtime) else contextlib.nullcontext()
        with reading:
            ckpt = self.checkpoint(step)  # gone meanwhile: CheckpointNotFoundError, never half read
            assert ckpt._stored is not None
            yield ckpt._stored

    def restore(self, state: Any, *, step: int | None = None, fallback: bool = False, strict: bool = True,
                discard_newer: bool = False) -> int | None:
        """Load the latest committed state checkpoint (or ``step``) into ``state`` in place.

        Returns the restored step, or None when there is no checkpoint yet. Only checkpoints
        of states count: a directory checkpoint (files given to ``report``) is skipped when
        looking for the latest, and naming one as ``step`` is an error (its files are had with
        ``checkpoint(step).to_directory(path)``). A newest checkpoint that does not verify is a
        ``CorruptCheckpointError`` naming the newest older one that does; with ``fallback``, that one
        is restored and the damaged newer ones are moved aside whole (``damaged.step_*``), so the
        run saves their steps again. Logs where it restored from (INFO). ``strict`` (as
        ``torch.nn.Module.load_state_dict``): keys of ``state`` that the checkpoint lacks, or the
        reverse, raise a ``StateError`` naming them; ``strict=False`` restores the keys that
        match and leaves the rest. ``discard_newer`` (with ``step``): delete the checkpoints
        newer than ``step`` after restoring it, so the run goes on from there. Also warms
        shared memory for saving ``state`` (not when read-only).
        """
        self._check_usable()
        if discard_newer and step is None:
            raise ConfigError("discard_newer=True needs step=: the checkpoint the run goes on from")
        if discard_newer:
            if self._writer().group is not None:
                raise ConfigError("discard_newer=True is not available in a multi-rank job; delete the newer "
                                  "checkpoints with `mpckpt rm` before the job starts")
        started = time.perf_counter()
        if isinstance(self._rt, Runtime) and self._rt.group is not None:
            restored = self._restore_ranked(state, step=step, fallback=fallback, strict=strict)
        else:
            restored = self._restore_one(state, step=step, fallback=fallback, strict=strict)
        if restored is None:
            log.info("mpckpt: no checkpoint in %s: starting fresh", self.url)
        else:
            log.info("mpckpt: restored step %d of %s from storage (%.1f s)", restored, self.url,
                     time.perf_counter() - started)
        if discard_newer and restored is not None:
            self._writer().discard_after(restored)
        if not self.read_only:
            self.prepare(state)
        return restored

    def _restore_one(self, state: Any, *, step: int | None, fallback: bool, strict: bool) -> int | None:
        """``restore`` in a process of its own: the newest checkpoint that verifies, or ``step``."""
        committed = self._rt.committed()
        damaged = dict(self._rt.damaged)
        if step is not None:
            manifest = committed.get(self._check_int(step))
            if manifest is not None and manifest.kind != "state":
                raise StateError(f"step {step} of {self.url} is a directory checkpoint (files given to report()), not a "
                                 f"state; get its files with ckpt.checkpoint({step}).to_directory(path)")
            candidates = [step]
        elif self.read_only and not fallback:  # a writer may delete what was just listed: look again
            try:
                step_read, loaded = load_newest(self._rt.backend, allow_pickle=self.config.allow_pickle, kind="state")
            except CheckpointNotFoundError:
                return None
            except CorruptCheckpointError as e:
                raise self._damaged_newest(e, sorted(committed, reverse=True)) from e
            apply_state(state, loaded, strict=strict, source=f"step {step_read} of {self.url}")
            return step_read
        else:
            states = [s for s, m in committed.items() if m.kind == "state"]
            candidates = sorted({*states, *damaged}, reverse=True)
        skipped: list[int] = []
        for candidate in candidates:
            try:
                if candidate in damaged:
                    raise damaged[candidate]
                loaded = self.load(candidate)
            except CorruptCheckpointError as e:
                if step is not None:
                    raise
                if not fallback:
                    raise self._damaged_newest(e, [c for c in candidates if c < candidate]) from e
                log.warning("mpckpt: step %s of %s does not verify, trying an older one: %s", candidate, self.url, e)
                skipped.append(candidate)
                continue
            apply_state(state, loaded, strict=strict, source=f"step {candidate} of {self.url}")
            if skipped and isinstance(self._rt, Runtime):  # the run goes on from here: those steps are saved again
                self._rt.set_aside(skipped)
            return candidate
        if candidates and fallback:
            raise CorruptCheckpointError(f"no checkpoint in {self.url} verifies (steps {candidates[:20]}); "
                                         "`mpckpt verify` says why for each")
        return None

    def _damaged_newest(self, e: CorruptCheckpointError, older: list[int]) -> CorruptCheckpointError:
        """The error of a newest checkpoint that does not verify: what happened, and the ways on."""
        intact = None
        for candidate in older[:_VERIFY_OLDER]:  # a few reads, once, on a path that otherwise stops the job
            try:
                self._verify(candidate)
            except MpckptError:
                continue
            intact = candidate
            break
        if intact is not None:
            where = f"The newest intact checkpoint is step {intact}."
        elif older:
            where = (f"None of the {min(len(older), _VERIFY_OLDER)} next older checkpoints verifies either "
                     f"(`mpckpt verify {self.url}` checks them all).")
        else:
            where = "There is no older checkpoint."
        return type(e)(
            f"the newest checkpoint in {self.url} does not verify: {e}. {where} To go on from the newest one that "
            f"verifies: restore(state, fallback=True) (it moves the damaged checkpoint aside, kept, and the run saves "
            f"its step again), or delete it (`mpckpt rm {self.url} <step> --damaged`, or "
            f"ckpt.delete(<step>, damaged=True)) and restart. The live state was not changed", path=e.path)

    def _verify(self, step: int) -> None:
        """Read every byte of checkpoint ``step`` against its checksums (``CorruptCheckpointError`` if not)."""
        with self._reading(step) as (backend, name, manifest):
            verify_checkpoint(backend, name, manifest)

    def _restore_ranked(self, state: Any, *, step: int | None, fallback: bool, strict: bool) -> int | None:
        """``restore`` on every rank of a job: each reads the byte ranges it needs (resharding).

        Every rank starts from the same committed checkpoints (rank 0's scan at open), so all
        pick the same step without talking. Optimizers without state yet get theirs first
        (as an optimizer step with zero gradients and learning rate 0 would make it), so that
        their DTensor moments are restored as shards like the parameters.
        """
        rt = self._writer()
        assert rt.group is not None
        committed = rt.committed()
        if step is not None:
            if self._check_int(step) not in committed:
                raise CheckpointNotFoundError(f"no committed checkpoint of step {step} in {self.url}; committed steps: "
                                              f"{sorted(committed)[-20:]}")
            candidates = [step]
        else:
            candidates = sorted((s for s, m in committed.items() if m.kind == "state"), reverse=True)
            newest_damaged = max(rt.damaged, default=-1)
            if not fallback and newest_damaged > max(candidates, default=-1):
                e = rt.damaged[newest_damaged]
                raise self._damaged_newest(e, candidates) if isinstance(e, CorruptCheckpointError) else e
        if not candidates:
            return None
        init_optimizer_state(state)
        flat = flatten(state, allow_pickle=self.config.allow_pickle, distributed=True)  # the live DTensors, by name
        assert flat.dist is not None
        targets = {flat.leaves[i].name: shard for i, shard in flat.dist.shards.items()}
        skipped: list[int] = []
        for candidate in candidates:
            name = checkpoint_name(candidate)
            failure: BaseException | None = None
            try:
                with rt.reading(candidate):
                    manifest = rt.complete(committed[candidate])
                    if manifest.ranked:
                        loaded, read = load_ranked_for(rt.backend, name, manifest, rank=rt.group.rank,
                                                       world_size=rt.group.world_size, targets=targets,
                                                       strict=strict, allow_pickle=self.config.allow_pickle)
                    else:  # saved by one process: every rank reads it whole and keeps its shards
                        loaded = shard_like_live(load_checkpoint(rt.backend, name, manifest,
                                                                 allow_pickle=self.config.allow_pickle), targets)
                        read = sum(e.size for e in manifest.files.values())
                apply_state(state, loaded, strict=strict, source=f"step {candidate} of {self.url}")
            except MpckptError as e:
                failure = e
            # every rank learns how every other fared, so all go on from the same step or all stop
            mine = None if failure is None else (str(failure), isinstance(failure, CorruptCheckpointError))
            every = rt.group.all_gather(mine)
            failed = [(r, f[0]) for r, f in enumerate(every) if f is not None]
            if not failed:
                self.stats.restored_bytes = read
                skipped = sorted({*skipped, *(s for s in rt.damaged if s > candidate)})
                if skipped:  # the job goes on from here: rank 0 moves them aside, then every rank goes on
                    rt.set_aside(skipped, move=rt.group.rank == 0)
                    rt.group.all_gather(None)
                return candidate
            corrupt = all(f[1] for f in every if f is not None)  # decided alike on every rank
            if fallback and step is None and corrupt:
                log.warning("mpckpt: step %s could not be restored on rank %s, trying an older one: %s", candidate,
                            failed[0][0], failed[0][1])
                skipped.append(candidate)
                continue
            if failure is not None:
                if isinstance(failure, CorruptCheckpointError) and step is None and candidate == candidates[0]:
                    raise self._damaged_newest(failure, candidates[1:]) from failure
                raise failure
            rank, why = failed[0]
            raise RankError(f"restoring step {candidate} failed on rank {rank}: {why}", step=candidate,
                            ranks=[r for r, _ in failed])
        raise CorruptCheckpointError(f"no checkpoint in {self.url} verifies")


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
