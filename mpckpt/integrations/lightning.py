"""Lightning: ``MpckptCheckpointIO``, a ``CheckpointIO`` plugin that saves through mpckpt.

This module owns the mapping between Lightning's checkpoint *files* and mpckpt *steps*, and
when each save runs; it imports lightning here and only here (``require``). What the files
hold, and how they are read and written, is ``lightning_files``.

``Trainer(plugins=[MpckptCheckpointIO(**checkpointer_options)])``. A save made inside the
Trainer's loops (every ``ModelCheckpoint`` save, a callback's ``trainer.save_checkpoint``) is
one ASYNC ``Checkpointer.save``: it returns once the state is copied into shared memory, and the
path Lightning named holds a *pointer* at once (so ``ModelCheckpoint``'s ``exists`` checks,
version counters, listings and ``save_last="link"`` work as with files). Once the step commits,
the ``mpckpt-lightning-files`` thread has the checkpoint written from the committed step, in a
process of its own, and renamed over the pointer: a Lightning checkpoint, as ``torch.save``
would have written it, for ``load_from_checkpoint`` and ``torch.load`` anywhere. The root stays
the durable, checksummed store.

A save made anywhere else (``trainer.save_checkpoint`` after ``fit()``, ``on_fit_start`` /
``on_fit_end`` / ``on_exception`` hooks, the ``ddp_spawn`` hand-back of the weights) has no
training to overlap with: it is written as ``TorchCheckpointIO`` writes it (``torch.save``,
atomically) before it returns, and opens nothing. Which is which is read from the call stack
(``called_from``): whether a Lightning loop is on it.

The mapping, per file:

* a save adds its step in front of the pointer's list (a real file already at the path stays
  until the new one replaces it); a crash before the commit leaves the previous candidates.
* ``save_id``: a random number, the checkpoint's metric ``lightning_save_id``: a candidate
  counts only if the committed checkpoint of its step carries it.
* each step's metric ``lightning_file`` names its file; once a file is written from step N,
  the root's older steps of that file are deleted, and ``remove_checkpoint(path)`` deletes all
  of its steps (a committed one now, a pending one right after its commit, never racing an
  upload or a file being written). The root keeps exactly the steps the files hold.
* ``load_checkpoint(path)``: a checkpoint file as ``TorchCheckpointIO`` loads it; a pointer:
  the newest committed step it names (waiting for this process's pending saves, and for another
  live process's), read with ``mpckpt.load`` on any rank.

``teardown()`` (end of fit/validate/test) waits for every pending commit and file, finishes
deletions, stops the thread and processes, closes the Checkpointers and raises what failed; a
background failure is also raised by the next ``save_checkpoint`` / ``remove_checkpoint`` /
``load_checkpoint``. A plugin pickles as a fresh one (``ddp_spawn``).
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from mpckpt.integrations import require

_lightning = require("lightning", "lightning")

from lightning.fabric.plugins import CheckpointIO  # noqa: E402
from lightning.fabric.utilities.cloud_io import _atomic_save, get_filesystem  # noqa: E402
from lightning.fabric.utilities.cloud_io import _load as pl_load  # noqa: E402

import mpckpt  # noqa: E402
from mpckpt.config import DEFAULT_TIMEOUT_S, UploadMode  # noqa: E402
from mpckpt.errors import (  # noqa: E402
    CheckpointNotFoundError,
    ConfigError,
    LockedError,
    MpckptError,
    StepOrderError,
    WaitTimeoutError,
    add_note,
)
from mpckpt.integrations import lightning_files as files  # noqa: E402
from mpckpt.integrations.lightning_files import Candidate, read_pointer  # noqa: E402
from mpckpt.options import given_settings  # noqa: E402

__all__ = ["MpckptCheckpointIO", "read_pointer"]

log = logging.getLogger("mpckpt")

# options that would fight what Lightning decides (what to keep, when to save, who saves)
_REFUSED = ("keep", "keep_last", "trigger", "read_only", "process_group")
_READ_OPTIONS = ("storage_options", "allow_pickle", "timeout_s")
_LOOPS = ("lightning.pytorch.loops", "pytorch_lightning.loops")
_LIGHTNING = ("lightning.pytorch.", "pytorch_lightning.")


def called_from() -> str:
    """``"loop"`` inside a Trainer's loops, ``"trainer"`` elsewhere in Lightning (after ``fit``,
    its setup/teardown hooks, launchers), ``""`` for a direct call (Fabric, a test)."""
    frame = sys._getframe(2)
    where = ""
    while frame is not None:
        module = frame.f_globals.get("__name__") or ""
        if module.startswith(_LOOPS):
            return "loop"
        if module.startswith(_LIGHTNING):
            where = "trainer"
        frame = frame.f_back  # type: ignore[assignment]
    return where


@dataclass(eq=False)
class _Save:
    """One snapshot save of a file, until its file is written (or it failed, or nobody wants it)."""

    path: str
    cand: Candidate
    future: Any            # mpckpt.SaveFuture
    ckpt: Any              # the root's writer Checkpointer
    pointed: bool          # the path holds a pointer naming it (False: a checkpoint file stays until replaced)
    doomed: bool = False   # its file was removed or saved over meanwhile: delete the step once committed
    finished: bool = False


class MpckptCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` that saves asynchronously through ``mpckpt.Checkpointer``.

    ``root``: where the checkpoints go (a folder or URL); default: a root per checkpoint folder,
    beside it (``<dirpath>.mpckpt``; ``<dirpath>/.mpckpt`` when an earlier mpckpt saved there).
    Every other keyword goes to ``mpckpt.Checkpointer`` (``memory_budget``, ``workers``,
    ``overlap``, ``storage_options``, ``allow_pickle``, ``timeout_s``, ``memory=`` ...); ``keep``,
    ``keep_last``, ``trigger``, ``read_only`` and ``process_group`` are refused, flat or in a group
    (``retention=``, ``job=``): Lightning's ``ModelCheckpoint`` decides what to keep and when to
    save, and the plugin who saves.
    """

    def __init__(self, root: str | os.PathLike[str] | None = None, **checkpointer_options: Any) -> None:
        given = given_settings(checkpointer_options)  # the groups (retention=, job=) spread into settings
        refused = [name for name in _REFUSED if name in checkpointer_options or name in given]
        if refused:
            raise ConfigError(f"MpckptCheckpointIO does not take {', '.join(refused)}: ModelCheckpoint(save_top_k=..., "
                              "every_n_train_steps=...) decides what to keep and when to save, and Lightning which "
                              "rank saves")
        self.root = None if root is None else files.norm(root)
        self.options = dict(checkpointer_options)
        self.stats: dict[str, mpckpt.CheckpointerStats] = {}  # per root: every save's figures (kept after close)
        self._next_step: dict[str, int] = {}  # per root (kept after close: steps only increase)
        self._start()

    def _start(self) -> None:
        """What a plugin holds while it saves: nothing yet (and again after ``teardown``, or unpickled)."""
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._open: dict[str, mpckpt.Checkpointer] = {}
        self._roots: dict[str, str] = {}                # checkpoint folder -> its default root (decided once)
        self._saves: list[_Save] = []                   # unfinished, in save order (mpckpt commits in that order)
        self._deletions: list[tuple[str, int]] = []     # committed steps to delete when mpckpt lets us
        self._failures: list[BaseException] = []        # from the background, raised by the next call
        # INVARIANT: a Checkpointer's save (training thread) and delete (files thread) never run at once
        self._saving = threading.Lock()
        self._files = files.FileWriter(self._file_job, self._file_done)

    def __getstate__(self) -> dict[str, Any]:
        return {"root": self.root, "options": self.options, "stats": self.stats, "_next_step": self._next_step}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._start()

    # -- Lightning's CheckpointIO --------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Inside the loops: snapshot ``checkpoint`` (returns after mpckpt's copy); the file follows
        the commit. Elsewhere: write the file now, as ``TorchCheckpointIO`` does."""
        if storage_options is not None:
            raise TypeError("MpckptCheckpointIO.save_checkpoint takes no storage_options; pass them once as "
                            "MpckptCheckpointIO(storage_options=...) (they go to the mpckpt root)")
        outside = called_from() == "trainer"
        self._settle(wait=False)
        path = files.norm(path)
        if outside:
            self._save_now(checkpoint, path)
            return
        root = self.root_for(path)
        fresh = root not in self._open
        ckpt = self._writer(root)
        step = self._next_step[root]
        cand = Candidate(root, step, secrets.randbits(48))  # never the user's `random` state
        metrics: dict[str, Any] = {files.SAVE_ID_METRIC: cand.save_id, files.FILE_METRIC: files.file_metric(root, path)}
        for key, name in (("global_step", "lightning_global_step"), ("epoch", "lightning_epoch")):
            value = checkpoint.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                metrics[name] = value
        try:
            with self._saving:
                if fresh:  # both slabs made now, so later saves only copy (the first save pays for them)
                    ckpt.prepare(checkpoint)
                future = ckpt.save(step, checkpoint, metrics=metrics, mode=UploadMode.ASYNC)
        except BaseException as e:
            add_note(e, f"mpckpt: while saving Lightning checkpoint {path} as step {step} of {root}")
            raise
        self._next_step[root] = step + 1
        assert future is not None  # no trigger: every save saves
        if fresh and not self._in_process(root, path):
            self._files.warm(ckpt, bool(self.options.get("allow_pickle")))
        with self._lock:
            pointer = read_pointer(path)
            save = _Save(path, cand, future, ckpt, pointed=pointer is not None or not files.exists(path))
            if save.pointed:
                older = [] if pointer is None else files.candidates(path, pointer)
                files.write_pointer(path, [cand, *older], epoch=checkpoint.get("epoch"),
                                    global_step=checkpoint.get("global_step"))
            self._saves.append(save)
        future.add_done_callback(lambda _f, s=save: self._files.submit(s))

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint at ``path``; for a pointer, the step it names (waiting for a pending save)."""
        self._settle(wait=False)
        text = files.norm(path)
        if not get_filesystem(text).exists(text):
            raise FileNotFoundError(f"Checkpoint file not found: {text}")
        pointer = read_pointer(text)
        if pointer is not None:
            names = set(files.candidates(text, pointer))
            for save in [s for s in self._saves if s.cand in names]:
                save.future.exception(self._timeout_s())  # ours, still being saved: its commit (or failure)
            opts = {k: v for k, v in self.options.items() if k in ("storage_options", "allow_pickle")}
            state = files.load_pointed(text, pointer, wait_s=self._timeout_s(), readers=self._open, **opts)
            if state is not None:
                if not isinstance(state, dict):
                    raise ConfigError(f"{text} points at a checkpoint that is not a Lightning checkpoint dict")
                return files.to_location(state, map_location)
        return pl_load(text, map_location=map_location, weights_only=weights_only)  # type: ignore[no-any-return]

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the file now; delete its steps now if committed, else right after their commit."""
        outside = called_from() == "trainer"
        self._settle(wait=False)
        text = files.norm(path)
        if not files.is_url(text) and os.path.islink(text):  # save_last="link": the link only, never its target
            os.remove(text)
            return
        self._forget(text, now=outside, remove=True)

    def teardown(self) -> None:
        """Wait for every pending commit and file, finish deletions, stop, close; raise what failed."""
        first: BaseException | None = None
        try:
            self._settle(wait=True)
        except BaseException as e:  # still finish the others and close
            first = e
        self._files.call(self._delete_due)
        self._files.close()  # after what was submitted: the last deletions
        first = first or next(iter(self._failures), None)
        for root, ckpt in list(self._open.items()):
            try:
                ckpt.close()
            except BaseException as e:
                first = first or e
            self._open.pop(root, None)
        self._start()
        if first is not None:
            raise first

    # -- saves outside the loops ------------------------------------------------------------
    def _save_now(self, checkpoint: dict[str, Any], path: str) -> None:
        """``TorchCheckpointIO``'s save; what the path held before is deleted once it is written."""
        held = self._release(path, remove=False)
        get_filesystem(path).makedirs(files.dirname(path), exist_ok=True)
        _atomic_save(checkpoint, path)
        self._delete(path, held, now=True)

    def _forget(self, path: str, *, now: bool, remove: bool) -> None:
        """Nothing holds what ``path`` held any more: its pending saves are deleted once committed,
        its committed steps now (``now``: with a Checkpointer opened for it if none is, closed after)."""
        self._delete(path, self._release(path, remove=remove), now=now)

    def _release(self, path: str, *, remove: bool) -> dict[str, list[int]]:
        """Doom the pending saves of ``path`` (``remove``: and the file); its committed steps, per root."""
        root = self.root_for(path)
        with self._lock:
            pointer = read_pointer(path)
            named = set() if pointer is None else {(c.root, c.step, c.save_id) for c in files.candidates(path, pointer)}
            for save in self._saves:
                if save.path == path:
                    save.doomed = True
            busy = {(s.cand.root, s.cand.step) for s in self._saves}
            if remove:
                files.remove(path)
        held = {}
        for r in sorted({root} | {r for r, _, _ in named}):
            steps = [s for s in self._steps_of(r, path, named) if (r, s) not in busy]
            if steps:
                held[r] = steps
        return held

    def _delete(self, path: str, held: dict[str, list[int]], *, now: bool) -> None:
        for root, steps in held.items():
            if root in self._open or not now:
                self._writer(root)  # opened here, on the training thread; deleted on the files thread
                with self._lock:
                    self._deletions.extend((root, s) for s in steps)
                self._files.call(self._delete_due)
                continue
            try:  # outside a run: a Checkpointer for the deletion only
                with mpckpt.Checkpointer(root, process_group=False, **self.options) as ckpt:
                    ckpt.delete(*steps)
            except LockedError as e:
                log.warning("mpckpt: %s held steps %s of %s, which stay (another process writes there): %s",
                            path, steps, root, e)

    def _steps_of(self, root: str, path: str, named: set[tuple[str, int, int]], reader: Any = None) -> list[int]:
        """Committed steps of ``root`` that hold ``path``: saved for it, or named by its pointer."""
        ckpt = reader or self._open.get(root)
        if ckpt is None:
            if not files.is_url(root) and not os.path.isdir(root):
                return []
            try:
                reader = mpckpt.Checkpointer(root, read_only=True,
                                             **{k: v for k, v in self.options.items() if k in _READ_OPTIONS})
            except MpckptError:
                return []
        else:
            reader = ckpt
        name = files.file_metric(root, path)
        try:
            out = []
            for step in reader.steps():
                metrics = reader.checkpoint(step).metrics
                if metrics.get(files.FILE_METRIC) == name or (root, step, metrics.get(files.SAVE_ID_METRIC)) in named:
                    out.append(step)
            return out
        finally:
            if reader is not ckpt:
                reader.close()

    # -- the mapping --------------------------------------------------------------------------
    def root_for(self, path: str | os.PathLike[str]) -> str:
        """The root a save of ``path`` goes to: ``root=``, else its folder's (``files.root_of_folder``)."""
        path = files.norm(path)
        if self.root is not None:
            return self.root
        folder = files.dirname(path)
        root = self._roots.get(folder)
        if root is None:
            options = {k: v for k, v in self.options.items() if k in _READ_OPTIONS}
            root = self._roots[folder] = files.root_of_folder(folder, **options)
        return root

    def _timeout_s(self) -> float:
        return float(self.options.get("timeout_s") or DEFAULT_TIMEOUT_S)

    def _writer(self, root: str) -> mpckpt.Checkpointer:
        ckpt = self._open.get(root)
        if ckpt is None:
            # Lightning calls CheckpointIO on the saving rank only: this rank writes the root alone
            ckpt = mpckpt.Checkpointer(root, process_group=False, **self.options)
            self._open[root] = ckpt
            self.stats[root] = ckpt.stats
            latest = ckpt.latest_step
            self._next_step[root] = max(self._next_step.get(root, 0), 0 if latest is None else latest + 1)
        return ckpt

    def _holds(self, save: _Save) -> bool:
        """Whether ``save``'s file is still meant to become its checkpoint (under the lock)."""
        if save.doomed or (not files.is_url(save.path) and os.path.islink(save.path)):
            return False
        if not save.pointed:
            return files.exists(save.path)
        pointer = read_pointer(save.path)
        return pointer is None and files.exists(save.path) or \
            pointer is not None and save.cand in files.candidates(save.path, pointer)

    # -- the mpckpt-lightning-files thread --------------------------------------------------------
    def _file_job(self, save: _Save) -> files.FileJob | None:
        """A save's commit is done: its file to write, or None (failed, replaced, removed)."""
        error = save.future.exception(0)
        result = None if error is not None else save.future.result(0)
        with self._lock:
            if error is not None or result is None or result.name is None:  # failed, or skipped by the budget
                if error is not None:
                    add_note(error, f"mpckpt: the Lightning checkpoint {save.path} (step {save.cand.step} of "
                                    f"{save.cand.root}) was not saved")
                    self._failures.append(error)
                self._fall_back(save)
                self._finished(save)
            else:
                newer = self._saves[self._saves.index(save) + 1:]
                replaced = any(s.path == save.path and s.future.done() and s.future.exception(0) is None
                               for s in newer)
                if replaced or not self._holds(save):  # a newer commit of the file is written instead
                    if save.doomed:
                        self._deletions.append((save.cand.root, save.cand.step))
                    self._finished(save)
        if save.finished:  # (a deletion refused while this save was pending may go now)
            self._delete_due()
            return None
        return files.FileJob(save.ckpt, save.cand.step, files.temporary_path(save.path, save.cand.step),
                             allow_pickle=bool(self.options.get("allow_pickle")),
                             in_process=self._in_process(save.cand.root, save.path))

    @staticmethod
    def _in_process(root: str, path: str) -> bool:
        """Storage only this process sees (``memory://``): its files are written by the thread itself."""
        return root.startswith("memory://") or path.startswith("memory://")

    def _file_done(self, save: _Save, job: files.FileJob | None, error: BaseException | None) -> None:
        if job is None:
            return
        written = False
        with self._lock:
            if error is None and self._holds(save):
                try:
                    files.replace(job.tmp, save.path)  # the file becomes the checkpoint, at once
                    written = True
                except OSError as e:
                    error = e
            if error is not None:
                add_note(error, f"mpckpt: the Lightning checkpoint file {save.path} was not written (step "
                                f"{save.cand.step} of {save.cand.root} is committed; the file stays a pointer to it)")
                self._failures.append(error)
            files.remove(job.tmp)
            if save.doomed:
                self._deletions.append((save.cand.root, save.cand.step))
            busy = {(s.cand.root, s.cand.step) for s in self._saves if not s.finished and s is not save}
            self._finished(save)
        if written:  # the root's older steps of this file go
            older = self._steps_of(save.cand.root, save.path, set(), reader=save.ckpt)
            with self._lock:
                self._deletions.extend((save.cand.root, s) for s in older
                                       if s < save.cand.step and (save.cand.root, s) not in busy)
        self._delete_due()

    def _finished(self, save: _Save) -> None:
        save.finished = True
        self._changed.notify_all()

    def _fall_back(self, save: _Save) -> None:
        """A save that failed: its file goes back to what it pointed at before (or goes)."""
        pointer = read_pointer(save.path) if save.pointed else None
        if pointer is None:
            return
        cands = files.candidates(save.path, pointer)
        if save.cand not in cands:
            return
        rest = [c for c in cands if c != save.cand]
        if rest:
            files.write_pointer(save.path, rest, epoch=pointer.get("epoch"), global_step=pointer.get("global_step"))
        else:
            files.remove(save.path)

    # -- on the training thread ------------------------------------------------------------------
    def _settle(self, wait: bool) -> None:
        """Forget finished saves (waiting for all of them with ``wait``); raise the first failure."""
        deadline = time.monotonic() + self._timeout_s() * 2
        with self._lock:
            while wait and any(not s.finished for s in self._saves):
                if time.monotonic() > deadline:
                    raise WaitTimeoutError(f"mpckpt: Lightning checkpoints still not written after "
                                           f"{self._timeout_s() * 2:g} s: {[s.path for s in self._saves][:5]}")
                self._changed.wait(1.0)
            self._saves = [s for s in self._saves if not s.finished]
            failures, self._failures = self._failures, []
        if wait:
            for ckpt in self._open.values():
                try:
                    ckpt.wait()
                except BaseException as e:
                    failures.append(e)
        if failures:
            raise failures[0]

    def _delete_due(self) -> None:
        """Delete the steps due (on the files thread: a delete waits on storage, never on training)."""
        with self._lock:
            due, self._deletions = list(dict.fromkeys(self._deletions)), []
        later = []
        for root, step in due:
            ckpt = self._open.get(root)
            if ckpt is None:
                continue  # closed meanwhile (teardown runs this last, with every Checkpointer open)
            try:
                with self._saving:
                    ckpt.delete(step)
            except CheckpointNotFoundError:
                pass  # gone already
            except StepOrderError:
                later.append((root, step))  # the newest while saves are pending: after the next commit
            except BaseException as e:
                add_note(e, f"mpckpt: while deleting step {step} of {root}, whose Lightning file is gone")
                with self._lock:
                    self._failures.append(e)
        with self._lock:
            self._deletions[:0] = later
