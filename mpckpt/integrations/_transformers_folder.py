"""The Hugging Face Trainer's folder layout, written from a state ``MpckptCallback`` saved.

This module owns the bytes of a ``checkpoint-N`` folder as the Trainer writes and reads it
(``model.safetensors``, ``config.json``, ``generation_config.json``, ``training_args.bin``,
``optimizer.pt``, ``scheduler.pt``, ``rng_state.pth`` and, of a job, ``rng_state_<rank>.pth``,
``trainer_state.json``: ``write_folder``), what of the model and the arguments goes into a save
so that such a folder can be written later from storage alone (``model_files``), and the thread
that writes them from storage once a step is committed (``FolderWriter``): every saved step's
``output_dir/checkpoint-N``, or only the best step's model folder. ``resume_path`` writes one
too. ``transformers.py`` decides when, and which; nothing here imports transformers.

Invariant: a folder appears whole or not at all (written beside it under a temporary name that
starts with a dot, then renamed), so a reader (``get_last_checkpoint``, the Trainer's rotation,
``from_pretrained``) never finds half of one.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import copy
import io
import json
import logging
import os
import re
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

import mpckpt
from mpckpt import Checkpointer, SaveFuture
from mpckpt.errors import CheckpointNotFoundError, StateError
from mpckpt.extension import executor
from mpckpt.integrations import require

log = logging.getLogger("mpckpt")

FORMAT = "mpckpt-transformers-1"  # the ``format`` value of every state MpckptCallback saves

# the keys of a save that hold the model's and the run's description, not training state
CONFIG, GENERATION_CONFIG, TRAINING_ARGS = "config", "generation_config", "training_args"
RANKS_RNG = "rng_ranks"  # under DDP: every rank's RNGState, in rank order (rng_state_<rank>.pth)
TRAINER_FOLDER = re.compile(r"^checkpoint-(\d+)$")  # a finished one, as get_last_checkpoint matches them
FOLDER = re.compile(r"^\.?checkpoint-(\d+)(\..*)?$")  # a checkpoint folder, or one being written (write_folder)


def model_files(model: Any, args: Any) -> dict[str, Any]:
    """What ``save_pretrained`` and the Trainer write beside the weights, taken once per ``train()``:
    ``config.json`` and ``generation_config.json`` as text, ``training_args.bin`` as the bytes of
    ``torch.save(args)`` (a uint8 tensor: stored as data, never unpickled by mpckpt)."""
    out: dict[str, Any] = {}
    config: Any = getattr(model, "config", None)
    if hasattr(config, "to_json_string") and not getattr(model, "_hf_peft_config_loaded", False):
        config = copy.deepcopy(config)
        dtype = getattr(model, "dtype", None)
        if isinstance(dtype, torch.dtype):
            config.dtype = str(dtype).split(".")[1]  # as save_pretrained records it
        config.architectures = [type(model).__name__]
        out[CONFIG] = config.to_json_string(use_diff=True)
    generation = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", None)
    if generation is not None and callable(can_generate) and can_generate():
        out[GENERATION_CONFIG] = generation.to_json_string(use_diff=True, keys_to_pop=["compile_config"])
    buffer = io.BytesIO()
    torch.save(args, buffer)
    out[TRAINING_ARGS] = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    return out


def write_folder(state: Mapping[str, Any], folder: str, *, training: bool = True,
                 processing_class: Any = None) -> None:
    """Write ``state`` (a save of ``MpckptCallback``, as ``mpckpt.load`` returns it) as the
    Trainer's ``folder``, replacing one that is there.

    ``training=False`` leaves out the optimizer, the scheduler and the generators (what
    ``Trainer.save_model`` writes, and the trainer state). ``processing_class`` (a tokenizer ...)
    is saved into it too, as the Trainer does.
    """
    parent = os.path.dirname(os.path.abspath(folder))
    os.makedirs(parent, exist_ok=True)
    staging = os.path.join(parent, f".{os.path.basename(folder)}.{os.getpid()}.{secrets.token_hex(4)}")
    os.makedirs(staging)
    try:
        _write_model(state["model"], os.path.join(staging, "model.safetensors"))
        for key, name in ((CONFIG, "config.json"), (GENERATION_CONFIG, "generation_config.json")):
            if key in state:
                with open(os.path.join(staging, name), "w", encoding="utf-8") as f:
                    f.write(str(state[key]))
        if TRAINING_ARGS in state:
            with open(os.path.join(staging, "training_args.bin"), "wb") as f:
                f.write(state[TRAINING_ARGS].numpy().tobytes())
        if training and "optimizer" in state:
            torch.save(state["optimizer"], os.path.join(staging, "optimizer.pt"))
            torch.save(state["scheduler"], os.path.join(staging, "scheduler.pt"))
        if training and "rng" in state:
            torch.save(_hf_rng(state["rng"]), os.path.join(staging, "rng_state.pth"))
        for rank, rng in enumerate((state.get(RANKS_RNG) or []) if training else []):  # a job's: every rank's
            torch.save(_hf_rng(rng), os.path.join(staging, f"rng_state_{rank}.pth"))
        with open(os.path.join(staging, "trainer_state.json"), "w", encoding="utf-8") as f:
            json.dump(json.loads(state["trainer_state"]), f, indent=2, sort_keys=True)
        if processing_class is not None and hasattr(processing_class, "save_pretrained"):
            processing_class.save_pretrained(staging)
        old = None
        if os.path.lexists(folder):  # the one there goes aside first: a folder is never half replaced
            old = staging + ".old"
            os.replace(folder, old)
        os.replace(staging, folder)  # INVARIANT: the folder appears whole
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _write_model(weights: Mapping[str, torch.Tensor], path: str) -> None:
    """``model.safetensors`` as the Trainer loads it; tied weights written under each name."""
    safetensors_torch = require("safetensors.torch", "transformers")
    seen: set[tuple[int, int]] = set()
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        key = (tensor.untyped_storage().data_ptr(), int(tensor.storage_offset()))
        tensors[name] = tensor.clone() if key in seen or not tensor.is_contiguous() else tensor
        seen.add(key)
    safetensors_torch.save_file(tensors, path, metadata={"format": "pt"})


def _hf_rng(rng: Mapping[str, Any]) -> dict[str, Any]:
    """``RNGState``'s parts as the Trainer's ``rng_state.pth`` holds them."""
    python = rng["python"]
    out: dict[str, Any] = {
        "python": (int(python["version"]), tuple(int(x) for x in python["internal"].tolist()), python["gauss_next"]),
        "cpu": rng["torch"],
    }
    if "numpy" in rng:
        np = require("numpy", "transformers")
        n = rng["numpy"]
        out["numpy"] = (n["name"], np.asarray(n["keys"].tolist(), dtype=np.uint32), int(n["pos"]),
                        int(n["has_gauss"]), float(n["cached_gaussian"]))
    if "cuda" in rng:
        cuda = list(rng["cuda"])
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        out["cuda"] = cuda if distributed else cuda[torch.cuda.current_device() if torch.cuda.is_available() else 0]
    return out


class FolderWriter:
    """Trainer folders ``<dir>/checkpoint-<step>``, written by one thread from storage, each once
    its step is committed (``Checkpointer.load``: the verified step, kept while it is read).

    Two uses. Every saved step's folder, as ``Trainer._save_checkpoint`` writes it (``training``),
    in save order, each followed by ``after(folder)`` (the Trainer's rotation). Or the best step's
    model folder only (``latest_only``, ``training=False``): a newer request supersedes one not yet
    started, and once one is written the older ones in ``dir`` are deleted. ``protect`` names a
    folder the rotation keeps (the best one). ``settle`` waits for what was asked, with a bound;
    ``stop`` ends the thread.
    """

    def __init__(self, directory: str | None = None, *, training: bool, processing_class: Any = None,
                 latest_only: bool = False, after: Callable[[str], None] | None = None) -> None:
        self.dir = directory
        self.training = training
        self.processing_class = processing_class
        self.latest_only = latest_only
        self.after = after
        self.protect: str | None = None  # read by ``after`` on the writer's thread
        self.step: int | None = None  # the newest asked for
        self.made: str | None = None  # the newest written
        self._asked: set[int] = set()
        self._jobs: dict[int, concurrent.futures.Future[None]] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def path(self, step: int) -> str:
        assert self.dir is not None
        return os.path.join(self.dir, f"checkpoint-{step}")

    def make(self, step: int, checkpointer: Checkpointer, saving: SaveFuture | None) -> None:
        """Ask for ``step``'s folder; ``saving``: its save, if not committed yet (None: committed)."""
        if self.dir is None or step in self._asked and (not self.latest_only or step == self.step):
            return
        self._asked.add(step)
        self.step = step
        if self._pool is None:
            self._pool = executor(1, "mpckpt-hf-folders")
        committed = threading.Event()
        if saving is None:
            committed.set()
        else:
            saving.add_done_callback(lambda _f: committed.set())  # (result() would take its error from the run)
        self._jobs[step] = self._pool.submit(self._write, step, checkpointer, saving, committed)

    def _write(self, step: int, checkpointer: Checkpointer, saving: SaveFuture | None,
               committed: threading.Event) -> None:
        committed.wait()
        if self.latest_only and step != self.step or saving is not None and saving.stats.status != "committed":
            return  # a newer best came meanwhile; or the save failed (the Checkpointer raises that)
        started = time.perf_counter()
        try:
            state = checkpointer.load(step)
        except CheckpointNotFoundError:
            # retention deleted it first: with save_total_limit the rotation would delete its folder too
            log.warning("mpckpt: step %d was deleted from %s (retention) before its folder in %s was written; "
                        "no folder for it", step, checkpointer.url, self.dir)
            return
        folder = self.path(step)
        write_folder(state, folder, training=self.training, processing_class=self.processing_class)
        self.made = folder
        if self.latest_only:
            assert self.dir is not None
            for name in os.listdir(self.dir):  # the older best folders, and any left half written by a crash
                if FOLDER.match(name) and name != os.path.basename(folder):
                    shutil.rmtree(os.path.join(self.dir, name), ignore_errors=True)
        if self.after is not None:
            self.after(folder)
        log.info("mpckpt: step %d written to %s for the Trainer (%.0f ms)", step, folder,
                 (time.perf_counter() - started) * 1e3)

    def due(self) -> list[int]:
        """The steps asked for whose folder is not settled yet (being written, or waiting for their commit)."""
        return sorted(step for step, job in self._jobs.items() if not job.done())

    def settle(self, timeout_s: float | None = None) -> tuple[list[int], list[tuple[int, BaseException]]]:
        """Wait up to ``timeout_s`` for the folders asked for: (the steps still due, the steps that
        failed with their errors). A failure is reported once, by this call or by ``stop``."""
        concurrent.futures.wait(list(self._jobs.values()), timeout=timeout_s)
        due = self.due()
        failed = []
        for step, job in list(self._jobs.items()):
            if job.done():
                del self._jobs[step]
                error = job.exception()
                if error is not None:
                    failed.append((step, error))
        return due, failed

    def stop(self, *, wait: bool = True) -> None:
        """End the thread: with ``wait``, after the folders asked for (a failure not settled yet is
        logged); without, those not started are dropped."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=wait, cancel_futures=not wait)
        for step, job in self._jobs.items():
            if job.done() and not job.cancelled() and job.exception() is not None:
                log.warning("mpckpt: could not write the folder of step %d in %s: %r", step, self.dir,
                            job.exception())
        self._jobs = {}


def rotation(output_dir: str, limit: int | None, writer: FolderWriter,
             trainer_rotate: Callable[..., None] | None) -> Callable[[str], None]:
    """The Trainer's rotation of its ``checkpoint-N`` folders (``save_total_limit``), to run after
    each folder is written: the newest ``limit`` and the best (``writer.protect``) stay.
    ``trainer_rotate``: transformers' own ``rotate_checkpoints`` (>= 5), else the same rule here."""
    def rotate(_folder: str) -> None:
        if not limit or limit <= 0:
            return
        if trainer_rotate is not None:
            trainer_rotate(output_dir=output_dir, save_total_limit=limit, best_model_checkpoint=writer.protect,
                           use_mtime=False)
            return
        steps = sorted((int(m.group(1)), name) for name in os.listdir(output_dir)
                       if (m := TRAINER_FOLDER.match(name)) and os.path.isdir(os.path.join(output_dir, name)))
        protected = {steps[-1][1]} if steps else set()
        if writer.protect is not None:
            protected.add(os.path.basename(writer.protect))
        extra = len(steps) - max(limit, len(protected))
        for _step, name in steps:
            if extra <= 0:
                break
            if name not in protected:
                shutil.rmtree(os.path.join(output_dir, name), ignore_errors=True)
                extra -= 1
    return rotate


# -- resume_path: a folder of a step, for resume_from_checkpoint --------------------------------------------------------------------------------------
_MADE: list[str] = []


def _remove_made() -> None:
    for path in _MADE:
        shutil.rmtree(path, ignore_errors=True)


atexit.register(_remove_made)


def resume_path(root: str | os.PathLike[str], step: int | None = None, *, directory: str | os.PathLike[str] | None = None,
                storage_options: Mapping[str, Any] | None = None) -> str | None:
    """What ``trainer.train(resume_from_checkpoint=...)`` takes: a folder in the Trainer's layout.

    Materialized from the newest committed checkpoint under ``root`` (or ``step``) into
    ``directory/checkpoint-<step>`` (default: a temporary folder removed at exit): the weights,
    optimizer, scheduler, generators and trainer state, with ``config.json``,
    ``generation_config.json`` and ``training_args.bin`` as the Trainer writes them.
    ``None`` when ``root`` has no checkpoint yet, so ``resume_from_checkpoint=resume_path(root)``
    starts a fresh run the first time and resumes afterwards. To go on from an older ``step``,
    give the callback ``discard_newer=True`` (the newer checkpoints are deleted when training starts).
    """
    started = time.perf_counter()
    try:
        state = mpckpt.load(root, step, storage_options=storage_options)
    except CheckpointNotFoundError:
        if step is not None:
            raise
        return None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise StateError(f"the checkpoint of {root} was not saved by MpckptCallback (no format {FORMAT!r}); "
                         "load it with mpckpt.load or Checkpointer.restore instead")
    saved_step = int(json.loads(state["trainer_state"])["global_step"])
    if directory is None:
        parent = tempfile.mkdtemp(prefix="mpckpt-hf-resume-")
        _MADE.append(parent)
    else:
        parent = os.fspath(directory)
    folder = os.path.join(parent, f"checkpoint-{saved_step}")
    write_folder(state, folder)
    log.info("mpckpt: step %s of %s materialized for the Trainer in %s (%.0f ms)", saved_step, root, folder,
             (time.perf_counter() - started) * 1e3)
    return folder
