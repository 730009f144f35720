"""Hugging Face Trainer: ``MpckptCallback`` saves through mpckpt; ``resume_path`` resumes from it.

This module owns the mapping between the Trainer's checkpoints (``checkpoint-N`` folders) and
mpckpt steps, and nothing else; it imports transformers here and only here (``require``). The
bytes of a ``checkpoint-N`` folder, and the thread that writes them, are ``_transformers_folder``'s.

``Trainer(..., callbacks=[MpckptCallback(root, **checkpointer_options)])`` (``root`` defaults to
``<output_dir>.mpckpt``, beside the output folder: the folder holds the Trainer's files only, so
its listings, ``get_last_checkpoint``, the rotation and ``push_to_hub`` of the folder never meet
the root; ``default_root``):

* **It takes the Trainer's saves over.** The Trainer decides *when* to save as always
  (``save_strategy``, ``save_steps``, the last step, ``save_strategy="best"``); the callback
  sees the decision in ``control.should_save`` (set by ``DefaultFlowCallback`` just before
  our ``on_step_end`` / ``on_epoch_end``), clears it, so the Trainer never writes its own
  folder, and makes one ASYNC ``Checkpointer.save(global_step, state)`` instead: the Trainer
  waits for the copy into shared memory only; the uploader processes write the files.
* **It saves what the Trainer would have saved, where the Trainer would have saved it.** The
  Trainer saves after that step's logging and evaluation (evaluation draws from the global
  random generator: every ``DataLoader`` iterator does). The callback takes the snapshot at the
  first event after that point, before anything changes the weights, the optimizer or the
  generators: the next ``on_step_begin`` (before the forward pass), the ``on_epoch_end`` or
  ``on_epoch_begin`` that follows, the log of the run's summary, or ``on_train_end``. The state:
  the model (``model``), the optimizer (``optimizer``), the LR scheduler (``scheduler``),
  ``mpckpt.RNGState()`` (``rng``: torch CPU and CUDA, Python ``random``, NumPy), the
  ``TrainerState`` as JSON (``trainer_state``, with this save's ``TrainerControl`` and
  ``ExportableState`` callbacks' states, which it also records in the live state, as the Trainer
  does), and what the Trainer writes beside the weights (``config``, ``generation_config``,
  ``training_args``). ``save_only_model=True`` leaves out the optimizer, scheduler and generators.
* **One lineage per root.** Steps only increase. A ``train()`` that starts before the root's
  newest step (a fresh run into a used root, a resume from an older step) would save nothing:
  ``on_train_begin`` raises a ``StepOrderError`` before the first step, unless
  ``discard_newer=True``, which deletes the checkpoints newer than the step it starts from.
* **Best model.** The Trainer records ``state.best_metric`` / ``best_global_step`` after the
  evaluation, before the snapshot. Only with ``save_strategy="best"`` does the callback record
  them itself in ``on_evaluate`` (the Trainer's strict comparison), so that the Trainer's own check
  finds nothing new and does not save: that is how that save is taken over (put the callback
  after ``EarlyStoppingCallback`` there: callbacks after it see the new best already). Once the
  best step is saved, ``state.best_model_checkpoint`` is that step's ``checkpoint-<step>``: in
  ``output_dir`` with the Trainer's folders; else in ``best_model_dir`` (default
  ``<output_dir>/mpckpt-best``), a folder a thread of the callback writes from storage
  once that step is committed (the model as ``Trainer.save_model`` writes it, and the trainer
  state); only the newest best is kept there. The end of ``train()`` waits for it, so the
  Trainer's own ``load_best_model_at_end`` loads from it.
* **Retention.** ``save_total_limit=N`` is ``KeepLast(N)``, joined with ``KeepBest(1,
  "eval_<metric>")`` when ``metric_for_best_model`` is set (the Trainer's rotation keeps the best
  too); mpckpt never deletes the newest. ``keep=`` / ``keep_last=`` given to the callback win.
  Every save's metrics are the evaluation metrics of its step and ``epoch``.
* **The Trainer's folders** (``trainer_folders=True``, the default). Once a step is committed, a
  thread of the callback reads it back from the root (verified) and writes
  ``output_dir/checkpoint-N`` as the Trainer's own save would (whole or not at all), then applies
  the Trainer's rotation (``save_total_limit``, keeping the best); ``best_model_checkpoint`` names
  the real folder. So ``get_last_checkpoint``, ``train(resume_from_checkpoint=True)``, a
  ``checkpoint-N`` path and ``from_pretrained`` of it work as without mpckpt; the Trainer's
  resume reads the folder (it loads it before and around ``on_train_begin``, where a callback
  cannot substitute the root). The cost: the state is stored twice. ``trainer_folders=False``
  writes none (then the best model's folder is ``<output_dir>/mpckpt-best/checkpoint-N``).
* ``on_train_end`` waits for every commit, then (from the run's summary log on) for the folders
  still due, at most ``folders_timeout_s`` in all, and closes the Checkpointer: when ``train()``
  returns, the last checkpoint is committed and its folder written (a failure, or a folder not
  written in time, is raised there).

``resume_path(root)`` gives what ``trainer.train(resume_from_checkpoint=...)`` takes: a local
folder that it materializes, once, from the newest committed checkpoint (or ``step``), in the
Trainer's own layout, so the Trainer's own resume (model, optimizer, scheduler, RNG at the
right moment of the epoch, the data skipped) runs unchanged and is as exact as with its own
folders. ``None`` when the root has no checkpoint yet, so the same line starts a fresh run.

Limits: one process saves (``args.should_save``, rank 0; under DDP every rank's generators are
gathered to it at each save, and ``resume_path`` writes each rank's ``rng_state_<rank>.pth``);
DeepSpeed and FSDP are refused (the Trainer saves them outside what a callback sees); the AMP
grad scaler and ``total_flos`` counted since the last log are not in the state; callbacks'
``on_save`` is not called (the Trainer calls it after its own save only), and the Trainer's push
of each checkpoint (inside its own save) does not happen. The states of ``ExportableState`` callbacks are read from the
Trainer's callback handler, found on the call stack (callbacks are not handed it); where it is
not found, only ``TrainerControl``'s state is refreshed. After the first optimizer step the
callback makes the shared memory of the saves once (``Checkpointer.prepare``), so every save is
a copy only.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Mapping
from typing import Any

import mpckpt
from mpckpt.config import UploadMode
from mpckpt.errors import ConfigError, MpckptError, StateError, StepOrderError
from mpckpt.integrations import require
from mpckpt.options import given_settings

_transformers = require("transformers", "transformers")

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments  # noqa: E402

from mpckpt.integrations._transformers_folder import (  # noqa: E402
    FOLDER,
    FORMAT,
    FolderWriter,
    model_files,
    resume_path,
    rotation,
)
from mpckpt.integrations._transformers_folder import RANKS_RNG as _RANKS_RNG  # noqa: E402
from mpckpt.integrations._transformers_rules import (  # noqa: E402
    SUMMARY_KEY,
    check_supported,
    ranks_rng,
    record_best,
    retention_of,
    trainer_state_of,
)

log = logging.getLogger("mpckpt")

__all__ = ["MpckptCallback", "resume_path"]

_BEST_DIR = "mpckpt-best"  # under output_dir: the best checkpoint's folder (trainer_folders=False)
ROOT_SUFFIX = ".mpckpt"  # the root when none is given: <output_dir>.mpckpt, beside the output folder


def default_root(output_dir: str | os.PathLike[str]) -> str:
    """The root ``MpckptCallback`` saves into when given none: ``<output_dir>.mpckpt``, beside the
    Trainer's output folder (inside it, ``<output_dir>/.mpckpt``, only for a folder with nothing
    beside it: ``/``)."""
    folder = os.path.abspath(os.fspath(output_dir))
    return folder + ROOT_SUFFIX if os.path.basename(folder) else os.path.join(folder, ROOT_SUFFIX)


class MpckptCallback(TrainerCallback):  # type: ignore[misc]
    """Save the Trainer's checkpoints through mpckpt (see the module docstring).

    ``root`` is any root a ``Checkpointer`` takes (a path, ``s3://``, ``az://`` ...; default
    ``<output_dir>.mpckpt``, beside it: ``default_root``);
    ``options`` go to ``mpckpt.Checkpointer`` (``memory_budget``, ``workers``, ``overlap``,
    ``keep``, ``keep_last``, ``storage_options`` ...). ``mode`` is the upload mode of each save
    (``ASYNC`` by default: the Trainer waits for the copy only).

    ``discard_newer``: when ``train()`` starts before the root's newest step (a fresh run into a
    used root, or a resume from an older step), delete the checkpoints newer than the step it
    starts from, and save on from there; by default that is a ``StepOrderError`` at
    ``on_train_begin``, before the first step.

    ``trainer_folders``: write the Trainer's ``output_dir/checkpoint-N`` folders from the committed
    steps, in the background (the state is then stored twice); ``False``: the root only.
    ``folders_timeout_s``: how long the end of ``train()`` waits for the folders still due before
    it raises. ``best_model_dir`` (with ``trainer_folders=False`` only): where the folder that
    ``state.best_model_checkpoint`` names is written (``True``: ``<output_dir>/mpckpt-best``;
    ``False``: not written, and ``best_model_checkpoint`` stays ``None``).
    """

    def __init__(self, root: str | os.PathLike[str] | None = None, *, mode: UploadMode | str = UploadMode.ASYNC,
                 trainer_folders: bool = True, folders_timeout_s: float = 600.0, discard_newer: bool = False,
                 best_model_dir: str | os.PathLike[str] | bool = True, **options: Any) -> None:
        if "read_only" in options:
            raise ConfigError("MpckptCallback saves; read_only= is not one of its options")
        if not isinstance(folders_timeout_s, (int, float)) or not folders_timeout_s > 0:
            raise ConfigError(f"MpckptCallback: folders_timeout_s must be a number of seconds > 0, not "
                              f"{folders_timeout_s!r}")
        if trainer_folders and best_model_dir is not True:
            raise ConfigError(f"MpckptCallback: best_model_dir={best_model_dir!r} applies with trainer_folders=False "
                              "only; with the Trainer's folders (the default) the best model's folder is the best "
                              "step's output_dir/checkpoint-N. Leave best_model_dir out, or give trainer_folders=False")
        self.root = root
        self.trainer_folders = bool(trainer_folders)
        self.folders_timeout_s = float(folders_timeout_s)
        self.mode = mode
        self.discard_newer = bool(discard_newer)
        self.best_model_dir = best_model_dir
        self.options = dict(options)
        self.checkpointer: mpckpt.Checkpointer | None = None
        self.futures: list[mpckpt.SaveFuture] = []  # every save of this process, in order
        self._pending: int | None = None  # len(log_history) when a save was claimed, until its snapshot
        self._eval_metrics: dict[int, dict[str, float]] = {}
        self._last_saved: int | None = None
        self._training = False
        self._prepared = False
        self._model_files: dict[str, Any] = {}
        self._saved: dict[int, mpckpt.SaveFuture | None] = {}  # steps in the root: None = committed before
        # the Trainer's checkpoint-N folders (trainer_folders), or the best step's model folder only
        self._folders = FolderWriter(training=True)
        self._folders_deadline: float | None = None  # when the end of train() stops waiting for them
        self._folders_failed: list[tuple[str, BaseException]] = []  # not raised yet

    # -- life ------------------------------------------------------------------------------------
    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        check_supported(args)
        self._training = True
        self._pending = None
        self._prepared = False
        if args.should_save and self.checkpointer is None:
            options = dict(self.options)
            given = given_settings(options)  # the groups (retention=, job=) spread into settings
            if "keep" not in given and "keep_last" not in given:
                keep = retention_of(args)
                if keep is not None:
                    options["keep"] = keep
            if args.world_size > 1:
                if "process_group" not in given and "process_group" not in options:
                    options["process_group"] = False  # rank 0 saves alone, as the Trainer does
            root = self.root if self.root is not None else default_root(str(args.output_dir))
            self.checkpointer = mpckpt.Checkpointer(root, **options)
            try:
                self._go_on_from(int(state.global_step), args)
            except BaseException:
                self.close()
                raise
            self._last_saved = self.checkpointer.latest_step
            self._saved = dict.fromkeys(self.checkpointer.steps())
            self._model_files = model_files(kwargs.get("model"), args)
            self._folders = self._folder_writer(args, kwargs.get("processing_class"))
            self._folders_deadline, self._folders_failed = None, []
            if state.best_global_step in self._saved:  # a resume: the folder may be on another machine
                self._best_saved(state, int(state.best_global_step))

    def _go_on_from(self, start: int, args: TrainingArguments) -> None:
        """Make the root go on from ``start`` when it holds newer steps (steps only increase, so
        nothing could be saved otherwise): a resume from an older ``checkpoint-N`` moves the newer
        checkpoints aside, whole (``superseded.step_*`` in the root: kept, no longer checkpoints),
        as the Trainer replaces its newer folders when it saves those steps again; with
        ``discard_newer`` they are deleted, with their folders; a fresh run (step 0) is refused."""
        assert self.checkpointer is not None
        latest = self.checkpointer.latest_step
        if latest is None or latest <= start:
            return
        newer = [s for s in self.checkpointer.steps() if s > start]
        if not self.discard_newer and start == 0:
            raise StepOrderError(
                f"MpckptCallback: {self.checkpointer.url} already holds checkpoints up to step {latest} "
                f"({newer[-5:]}), and this train() is a fresh run (step 0); steps must increase, so none of its "
                "saves could be made. To go on from the newest: train(resume_from_checkpoint=True) (without the "
                "folders: resume_path(root)); to start "
                "afresh and delete them: MpckptCallback(root, discard_newer=True); to keep them: a new root "
                "(another output_dir)")
        if not self.discard_newer:
            log.warning("mpckpt: train() resumes from step %d of %s, which holds newer checkpoints %s: moving them "
                        "aside (superseded.step_* in the root, kept; delete them when done), as the Trainer replaces "
                        "its newer folders; MpckptCallback(discard_newer=True) deletes them instead",
                        start, self.checkpointer.url, newer)
            self.checkpointer.discard_newer(start, keep=True)
            return
        log.warning("mpckpt: discard_newer=True: train() starts from step %d; deleting the newer checkpoints %s "
                    "of %s", start, newer, self.checkpointer.url)
        self.checkpointer.discard_newer(start)
        folders = self._folders_dir(args)
        if folders is not None and os.path.isdir(folders):  # the folders of the discarded steps
            for name in os.listdir(folders):
                found = FOLDER.match(name)
                if found and int(found.group(1)) > start:
                    shutil.rmtree(os.path.join(folders, name), ignore_errors=True)

    def _folders_dir(self, args: TrainingArguments) -> str | None:
        """Where the folders go: ``output_dir`` (trainer_folders), else the best model's folder's parent."""
        if self.trainer_folders:
            return str(args.output_dir)
        if self.best_model_dir is False or self.best_model_dir is None:
            return None
        if self.best_model_dir is True:
            return os.path.join(str(args.output_dir), _BEST_DIR)
        return os.fspath(self.best_model_dir)

    def _folder_writer(self, args: TrainingArguments, processing_class: Any) -> FolderWriter:
        directory = self._folders_dir(args)
        if not self.trainer_folders:
            return FolderWriter(directory, training=False, processing_class=processing_class, latest_only=True)
        assert directory is not None
        if os.path.isdir(directory):  # folders a crashed run left half written (never a checkpoint-N)
            for name in os.listdir(directory):
                if name.startswith(".checkpoint-") and FOLDER.match(name):
                    shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
        writer = FolderWriter(directory, training=True, processing_class=processing_class)
        writer.after = rotation(directory, args.save_total_limit, writer,
                                getattr(_transformers.trainer_utils, "rotate_checkpoints", None))
        return writer

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               **kwargs: Any) -> None:
        if self._training and SUMMARY_KEY in (kwargs.get("logs") or {}):
            # the run's summary: next, the Trainer loads the best model (load_best_model_at_end),
            # which changes the weights (from best_model_checkpoint), then rotates the folders:
            # the last snapshot is taken now, and the folders still due are waited for
            self._flush(args, state, control, kwargs)
            self._settle_folders(state, raise_errors=False)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        try:
            self._flush(args, state, control, kwargs)
            if self.checkpointer is not None:
                self.checkpointer.wait()
            self._settle_folders(state, raise_errors=True)
            if args.load_best_model_at_end and self.checkpointer is not None and state.best_model_checkpoint is None:
                self._load_best(state, kwargs.get("model"))  # no folder for the Trainer to load it from
        finally:
            self._training = False
            self.close()

    def wait(self) -> None:
        """Wait until every save so far is committed; raise what failed."""
        if self.checkpointer is not None:
            self.checkpointer.wait()

    def close(self) -> None:
        """Wait for every save, stop the uploaders; ``on_train_end`` does this (also after a crash:
        call it, or let the Checkpointer's finalizer commit what is pending at exit)."""
        checkpointer, self.checkpointer = self.checkpointer, None
        try:
            self._folders.stop(wait=not self._folders.due() or self._folders_deadline is None)
        finally:
            if checkpointer is not None:
                checkpointer.close()

    # -- when to save ----------------------------------------------------------------------------
    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      **kwargs: Any) -> None:
        self._flush(args, state, control, kwargs)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        if not self._prepared and self.checkpointer is not None and args.save_strategy != "no":
            # after the first optimizer step the optimizer has its state: make the shared memory of
            # the saves now, once, so that every save is a copy only (mpckpt's prepare())
            self._prepared = True
            snapshot = self._state(args, state, control, kwargs, len(state.log_history))[0]
            if not args.save_only_model and args.world_size > 1:  # the sizes of the ranks' generators
                snapshot[_RANKS_RNG] = [mpckpt.RNGState().state_dict()] * args.world_size
            self.checkpointer.prepare(snapshot)
        self._claim(state, control)

    def on_epoch_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        self._flush(args, state, control, kwargs)

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self._flush(args, state, control, kwargs)  # a save claimed at the epoch's last step
        self._claim(state, control)

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        metrics = kwargs.get("metrics") or {}
        if not self._training or state.global_step == 0:  # eval_on_start: the Trainer records no best either
            return
        self._eval_metrics[state.global_step] = {
            str(k): float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if args.save_strategy == "best" and record_best(args, state, metrics):
            control.should_save = True
        self._claim(state, control)

    def _claim(self, state: TrainerState, control: TrainerControl) -> None:
        """The Trainer decided to save at this step: the snapshot is ours (taken at the next event)."""
        if not control.should_save or not self._training:
            return
        control.should_save = False  # the Trainer's own, synchronous save does not happen
        if self._pending is None:
            self._pending = len(state.log_history)

    def _flush(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               kwargs: Mapping[str, Any]) -> None:
        """Take the claimed snapshot now: nothing changed since the Trainer's save point."""
        if self._pending is None:
            return
        claimed_at, self._pending = self._pending, None
        # every rank's generators, gathered on every rank at the same event (rank 0 saves them)
        ranks = None if args.save_only_model else ranks_rng()
        step = int(state.global_step)
        if self.checkpointer is None or self._last_saved is not None and step <= self._last_saved:
            return  # another process saves; or this step is saved already (a step save, then an epoch save)
        best = state.best_global_step
        if best is not None and (best == step or best in self._saved):
            self._best_saved(state, int(best))  # the Trainer records the folder before its trainer_state.json
        snapshot, callbacks = self._state(args, state, control, kwargs, claimed_at)
        if ranks is not None:
            snapshot[_RANKS_RNG] = ranks
        metrics = {"epoch": float(state.epoch or 0.0), **self._eval_metrics.get(step, {})}
        self._eval_metrics = {s: m for s, m in self._eval_metrics.items() if s > step}
        future = self.checkpointer.save(step, snapshot, metrics=metrics, mode=self.mode, force=True)
        state.stateful_callbacks = callbacks  # type: ignore[assignment]  # as the Trainer records them at its save
        if future is not None:
            self.futures.append(future)
            self._saved[step] = future
            if self.trainer_folders or best == step:
                self._folders.make(step, self.checkpointer, future)
        self._last_saved = step

    def _best_saved(self, state: TrainerState, best: int) -> None:
        """The best step is (being) saved: ``best_model_checkpoint`` names its folder, made once
        committed (the rotation keeps it)."""
        folders = self._folders
        if folders.dir is None or self.checkpointer is None:
            return
        path = state.best_model_checkpoint = folders.protect = folders.path(best)
        if best not in self._saved:
            return  # being saved now: asked for once the save is made
        saving = self._saved[best]
        if saving is None and os.path.isdir(path):  # committed before this run, and written then
            if folders.latest_only:
                folders.step, folders.made = best, path
            return
        folders.make(best, self.checkpointer, saving)  # (once: asked for already is a no-op)

    def _settle_folders(self, state: TrainerState, *, raise_errors: bool) -> None:
        """The end of ``train()``: wait for the folders still due, until ``folders_timeout_s`` after
        the first call; ``raise_errors``: raise what could not be written, or was not in time."""
        folders = self._folders
        if self._folders_deadline is None:
            self._folders_deadline = time.monotonic() + self.folders_timeout_s
        due, failed = folders.settle(max(0.0, self._folders_deadline - time.monotonic()))
        what = "the Trainer's folder" if self.trainer_folders else "the best checkpoint's folder"
        self._folders_failed += [(f"{what} {folders.path(step)} (step {step}): {error!r}", error)
                                 for step, error in failed]
        best = state.best_model_checkpoint
        if best is not None and folders.dir is not None and os.path.dirname(best) == folders.dir \
                and not os.path.isdir(best):
            # its save was not committed (raised at on_train_end), or its folder is not there
            state.best_model_checkpoint = folders.made if folders.latest_only else None
        if not raise_errors:
            return
        url = self.checkpointer.url if self.checkpointer is not None else "the root"
        if self._folders_failed:
            problems, self._folders_failed = self._folders_failed, []
            raise MpckptError(f"MpckptCallback: could not write {'; '.join(p for p, _ in problems)}. The checkpoints "
                              f"themselves are committed in {url} (resume_path(root, step) writes such a folder "
                              "again)") from problems[0][1]
        if due:
            raise MpckptError(
                f"MpckptCallback: {what}s of steps {due} in {folders.dir} were not written within folders_timeout_s="
                f"{self.folders_timeout_s:g} s of the end of training (their checkpoints are committed in {url}; "
                "resume_path(root, step) writes one). Give a larger folders_timeout_s, or trainer_folders=False to "
                "write none")

    def _state(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               kwargs: Mapping[str, Any], claimed_at: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """What one save holds (mpckpt calls the objects' ``state_dict()``), and the callbacks' states."""
        model, optimizer, scheduler = kwargs.get("model"), kwargs.get("optimizer"), kwargs.get("lr_scheduler")
        if model is None:
            raise StateError("MpckptCallback: the Trainer passed no model to the callback; nothing to save")
        trainer_state = trainer_state_of(state, control, claimed_at)
        snapshot: dict[str, Any] = {"format": FORMAT, "model": model,
                                    "trainer_state": json.dumps(trainer_state, sort_keys=True), **self._model_files}
        if not args.save_only_model:
            if optimizer is None or scheduler is None:
                raise StateError("MpckptCallback: the Trainer passed no optimizer or LR scheduler to the callback")
            snapshot.update(optimizer=optimizer, scheduler=scheduler, rng=mpckpt.RNGState())
        return snapshot, trainer_state["stateful_callbacks"]

    def _load_best(self, state: TrainerState, model: Any) -> None:
        """``load_best_model_at_end`` without a best folder: the best committed checkpoint's weights."""
        assert self.checkpointer is not None
        best = state.best_global_step
        if not best or model is None:
            return
        if best not in self.checkpointer.steps():
            log.warning("mpckpt: the best step %s was evaluated but not saved; the model stays the last one", best)
            return
        model.load_state_dict(self.checkpointer.load(best)["model"])
        log.info("mpckpt: loaded the best model (step %s, %s=%s)", best, "best_metric", state.best_metric)
