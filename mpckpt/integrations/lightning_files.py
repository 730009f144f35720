"""The files ``MpckptCheckpointIO`` leaves at the paths Lightning names: Lightning checkpoints,
and *pointers* while those are being written. Needs torch, never lightning.

A ``.ckpt`` file has two forms:

* **a pointer**, from the moment ``save_checkpoint`` returns until its step commits and the file
  is written: a small ``torch.save`` file whose one object names the mpckpt root, the steps it
  stands for (newest first, each with the ``save_id`` its checkpoint carries as the metric
  ``lightning_save_id``) and the process saving them. Lightning's checks on the path itself
  (``exists``, listings, ``modified`` times, symlinks) behave as with ``torch.save`` files.
  ``torch.load`` finds a call of ``checkpoint_not_written_yet`` in it: with ``weights_only=True``
  (torch's default) torch refuses it *naming that function* (never "invalid load key"); with
  ``weights_only=False``, or the function allowed through ``torch.serialization.safe_globals``,
  the call returns the checkpoint: the newest committed step it names, read from the root
  (no code from storage runs), after waiting while the saving process lives and nothing is
  committed yet.
* **a Lightning checkpoint**: once the step commits, a process of its own (mpckpt's validator
  process, running ``write_checkpoint_file``) reads the committed step back, checksums verified,
  and ``torch.save``s it into a hidden temporary file beside the path (fsynced), which the plugin
  renames over the pointer: what ``TorchCheckpointIO`` writes, with CPU tensors, for
  ``torch.load(weights_only=True)`` and ``LightningModule.load_from_checkpoint``.

``read_pointer`` tells a pointer from a checkpoint without running code from the file; it reads
version 1 pointers too (JSON: mpckpt before the files became checkpoints). Each saved step
carries the metric ``lightning_file``: its file's name when the root serves the file's folder
(beside it or inside it, local paths: the pair stays movable), its whole path otherwise.

Paths and the default root of a checkpoint folder (beside it, ``<dirpath>.mpckpt``) are
``_lightning_paths``'s.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import logging
import os
import pickle
import queue
import socket
import threading
import time
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import mpckpt
from mpckpt import extension
from mpckpt.config import DEFAULT_TIMEOUT_S
from mpckpt.errors import CheckpointNotFoundError, ConfigError, add_note
from mpckpt.integrations._lightning_paths import (  # noqa: F401 -- the plugin reaches them through this module
    OLD_ROOT_NAME,
    ROOT_SUFFIX,
    default_root,
    dirname,
    exists,
    file_metric,
    fs_of,
    is_url,
    join,
    norm,
    remove,
    root_of_folder,
    serves,
    temporary_path,
)

__all__ = ["checkpoint_not_written_yet", "read_pointer"]

log = logging.getLogger("mpckpt")

POINTER_KEY = "mpckpt_lightning"
POINTER_VERSION = 2
SAVE_ID_METRIC = "lightning_save_id"
FILE_METRIC = "lightning_file"
_WRITE_TO = "_mpckpt_lightning_write_to"  # a file job's temporary file, in the manifest copy the job gets
_POINTER_MAX_BYTES = 1 << 20
_POLL_S = 0.2
_NOTE = ("A Lightning checkpoint that mpckpt is still writing (MpckptCheckpointIO): this file becomes the checkpoint "
         "once its step commits. Load it through MpckptCheckpointIO, or torch.load(path, weights_only=False), which "
         "waits for the step and reads it from the root.")


@dataclass(frozen=True)
class Candidate:
    root: str     # as resolved for this process (absolute path or URL)
    step: int
    save_id: int


# -- pointers ------------------------------------------------------------------------------------
class _Pointer:
    """What a pointer file holds for ``torch.save``: a call of ``checkpoint_not_written_yet(body)``."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body

    def __reduce__(self) -> tuple[Any, ...]:
        return checkpoint_not_written_yet, (self.body,)


def pointer_bytes(path: str, cands: list[Candidate], *, epoch: Any = None, global_step: Any = None,
                  sharded: bool = False) -> bytes:
    """The pointer at ``path`` naming ``cands`` (newest first), as ``torch.save`` writes it
    (``sharded``: the steps are sharded saves of ``lightning_dcp``'s strategies)."""
    import torch

    where = dirname(path)
    entries = []
    for c in cands:
        root = c.root
        if not is_url(path) and serves(root, where):  # the pair stays movable; read back from the real folder
            root = os.path.relpath(os.path.realpath(root), os.path.realpath(where))
        entries.append({"root": root, "step": c.step, "save_id": c.save_id})
    body: dict[str, Any] = {POINTER_KEY: POINTER_VERSION, "note": _NOTE, "path": path, "candidates": entries,
                            "host": socket.gethostname(), "pid": os.getpid()}
    body.update({k: v for k, v in (("epoch", epoch), ("global_step", global_step))
                 if isinstance(v, int) and not isinstance(v, bool)})
    if sharded:
        body["sharded"] = True
    buffer = io.BytesIO()
    torch.save(_Pointer(body), buffer)
    return buffer.getvalue()


def write_pointer(path: str, cands: list[Candidate], **extra: Any) -> None:
    data = pointer_bytes(path, cands, **extra)
    if is_url(path):
        fs, p = fs_of(path)
        fs.makedirs(dirname(p), exist_ok=True)
        fs.pipe_file(p, data)
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)  # whole or not at all; a symlink to it (save_last="link") follows


class _PointerUnpickler(pickle.Unpickler):
    """Unpickles a pointer's body and nothing else: no other global, no tensor."""

    def find_class(self, module: str, name: str) -> Any:
        if module == __name__ and name == "checkpoint_not_written_yet":
            return _body
        raise pickle.UnpicklingError(f"{module}.{name} is not part of an mpckpt pointer")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("an mpckpt pointer holds no tensors")


def _body(body: Any) -> Any:
    return body


_MARK = f"{__name__}\ncheckpoint_not_written_yet\n".encode()


def read_pointer(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The pointer at ``path`` as stored (``root`` as written), or None when ``path`` is none (a
    checkpoint, another file, nothing). Runs no code from the file."""
    text = os.fspath(path)
    try:
        if is_url(text):
            fs, p = fs_of(text)
            if not fs.isfile(p) or fs.size(p) > _POINTER_MAX_BYTES:
                return None
            data = fs.cat_file(p)
        else:
            if not os.path.isfile(text) or os.path.getsize(text) > _POINTER_MAX_BYTES:
                return None
            with open(text, "rb") as f:
                data = f.read(_POINTER_MAX_BYTES)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    body: Any = None
    if data.lstrip().startswith(b"{"):  # version 1: JSON
        with contextlib.suppress(ValueError):
            body = json.loads(data)
        return body if isinstance(body, dict) and body.get(POINTER_KEY) == 1 else None
    if not data.startswith(b"PK\x03\x04"):
        return None
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            names = [n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            pickled = z.read(names[0]) if len(names) == 1 else b""
        if _MARK in pickled[:256]:
            body = _PointerUnpickler(io.BytesIO(pickled)).load()
    except (zipfile.BadZipFile, pickle.UnpicklingError, EOFError, ValueError, KeyError):
        return None
    return body if isinstance(body, dict) and body.get(POINTER_KEY) == POINTER_VERSION else None


def candidates(path: str, pointer: Mapping[str, Any]) -> list[Candidate]:
    """The steps ``pointer`` (read at ``path``) names, newest first, roots resolved."""
    where = dirname(path if is_url(path) else os.path.realpath(path))  # a link's pointer: its own folder
    out = []
    for c in pointer.get("candidates", []):
        root = str(c["root"])
        if not is_url(root) and not os.path.isabs(root):
            root = os.path.normpath(os.path.join(where, root))
        out.append(Candidate(root, int(c["step"]), int(c["save_id"])))
    return out


def _saver_alive(pointer: Mapping[str, Any]) -> bool:
    """Whether the process that wrote ``pointer`` may still commit its steps (unknown: yes)."""
    pid = pointer.get("pid")
    if not isinstance(pid, int) or pointer.get("host") != socket.gethostname():
        return isinstance(pid, int)  # a version 1 pointer names no process; another machine's: maybe
    import psutil

    return bool(psutil.pid_exists(pid))


# -- reading what a pointer names ----------------------------------------------------------------
def load_committed(cand: Candidate, *, reader: Any = None, **options: Any) -> Any | None:
    """The state of ``cand`` if its step is committed and is the save it names, else None.

    ``reader``: an open Checkpointer of ``cand.root`` to read through; else a read-only one is
    opened (``options``: ``storage_options``, ``allow_pickle``) and closed.
    """
    own = reader is None
    if own:
        if not is_url(cand.root) and not os.path.isdir(cand.root):
            return None
        reader = mpckpt.Checkpointer(cand.root, read_only=True, **options)
    try:
        try:
            if reader.checkpoint(cand.step).metrics.get(SAVE_ID_METRIC) != cand.save_id:
                return None  # that step number was saved again by a later run: not this file's checkpoint
            return reader.load(cand.step)
        except CheckpointNotFoundError:
            return None
    finally:
        if own:
            reader.close()


def load_pointed(path: str, pointer: Mapping[str, Any], *, wait_s: float,
                 readers: Mapping[str, Any] | None = None, **options: Any) -> Any | None:
    """The newest committed checkpoint ``pointer`` (read at ``path``) names.

    While nothing it names is committed and the saving process is alive, waits (up to
    ``wait_s``), reading the file again: None once it became a checkpoint (read it as one);
    ``FileNotFoundError`` saying why when nothing can be loaded.
    """
    if pointer.get("sharded"):
        raise ConfigError(f"{path} is a sharded Lightning checkpoint in an mpckpt root: load it with the strategy "
                          "that saved it (mpckpt.integrations.lightning_dcp.MpckptFSDPStrategy or "
                          "MpckptModelParallelStrategy), or its full tensors with mpckpt.load(root, step)")
    deadline, said = time.monotonic() + wait_s, False
    while True:
        tried = []
        for cand in candidates(path, pointer):
            state = load_committed(cand, reader=(readers or {}).get(cand.root), **options)
            if state is not None:
                return state
            tried.append(f"step {cand.step} of {cand.root}")
        now = read_pointer(path)
        if now is None:
            if exists(path):
                return None  # written meanwhile: a checkpoint now
            raise FileNotFoundError(f"{path} was removed while it was read (Lightning's top-k deleted it?)")
        if now != pointer:
            pointer = now
            continue
        alive = _saver_alive(pointer)
        if not alive or time.monotonic() >= deadline:
            why = f"still not committed after {wait_s:g} s" if alive else "never committed (its saving process is gone)"
            raise FileNotFoundError(
                f"{path} is a Lightning checkpoint mpckpt has not written: {', '.join(tried) or 'no step'}, {why}. "
                "Steps that did commit: `mpckpt ls <root>`; a run resumes from an older file (ckpt_path=...)")
        if not said:
            log.info("mpckpt: %s: waiting for %s to commit (the save this file stands for)", path, tried[0])
            said = True
        time.sleep(_POLL_S)


def checkpoint_not_written_yet(pointer: dict[str, Any]) -> Any:
    """What ``torch.load`` of a pointer gives when allowed to call this (``weights_only=False``):
    the checkpoint the file stands for, read from the mpckpt root (waiting while its save is
    still pending in a live process, up to mpckpt's ``timeout_s`` default), or a
    ``FileNotFoundError`` saying why there is none.

    ``torch.load(path)`` with torch's default ``weights_only=True`` refuses to call it and names
    it: the file is a Lightning checkpoint that mpckpt (``MpckptCheckpointIO``) is still writing.
    """
    if not isinstance(pointer, dict) or pointer.get(POINTER_KEY) != POINTER_VERSION:
        raise ValueError("not an mpckpt pointer")
    path = str(pointer.get("path", ""))
    state = load_pointed(path, pointer, wait_s=DEFAULT_TIMEOUT_S)
    if state is None:  # the file became the checkpoint meanwhile
        import torch

        return torch.load(path, weights_only=True)
    return state


# -- writing the checkpoint files ----------------------------------------------------------------
def write_checkpoint_file(checkpoint: Any, *, allow_pickle: bool = False) -> dict[str, int]:
    """Write the committed state ``checkpoint`` (an ``mpckpt.Checkpoint``) with ``torch.save`` into
    the temporary file its job names; return its size. Runs in the validator process."""
    import torch

    target = str(checkpoint.metrics[_WRITE_TO])
    state = checkpoint.load(allow_pickle=allow_pickle)
    if is_url(target):
        fs, p = fs_of(target)
        with fs.open(p, "wb") as f:
            torch.save(state, f)
        return {"bytes": int(fs.size(p))}
    torch.save(state, target)
    fd = os.open(target, os.O_RDONLY)
    try:
        os.fsync(fd)  # INVARIANT: the file is on disk before it is renamed over the pointer
    finally:
        os.close(fd)
    return {"bytes": os.path.getsize(target)}


@dataclass
class _Call:
    fn: Callable[[], None]


@dataclass
class FileJob:
    ckpt: Any          # the writer Checkpointer of the root
    step: int
    tmp: str
    allow_pickle: bool
    in_process: bool   # storage only this process sees (memory://): written by the thread itself


class FileWriter:
    """The ``mpckpt-lightning-files`` thread: checkpoint files from committed steps, in commit order,
    and whatever else must stay off the training thread (``call``: the plugin's deletions).

    For each submitted item, ``prepare(item)`` (under the plugin's rules) returns the ``FileJob``
    to run or None; the job runs in a validator process of the root (started at its first file,
    below training); then ``finish(item, job, error)``. No callback may raise.
    """

    def __init__(self, prepare: Callable[[Any], FileJob | None],
                 finish: Callable[[Any, FileJob | None, BaseException | None], None]) -> None:
        self._prepare, self._finish = prepare, finish
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._procs: dict[str, Any] = {}
        self._closing = False
        self._started = threading.Lock()

    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the thread, after what was submitted before."""
        self.submit(_Call(fn))

    def submit(self, item: Any) -> None:
        with self._started:
            if self._thread is None:
                self._closing = False
                self._thread = extension.Thread(target=self._run, name="mpckpt-lightning-files", daemon=True)
                self._thread.start()
        self._queue.put(item)

    def close(self) -> None:
        """Finish what was submitted, stop the thread and the processes."""
        with self._started:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._closing = True  # a file still being written now is given up (its step stays committed)
            self._queue.put(None)
            thread.join()
        for proc in self._procs.values():
            proc.close()
        self._procs.clear()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, _Call):
                item.fn()
                continue
            job = self._prepare(item)
            error: BaseException | None = None
            if job is not None:
                try:
                    self._write(job)
                except BaseException as e:  # the step stays committed; its file stays a pointer
                    error = e
            self._finish(item, job, error)

    def _write(self, job: FileJob) -> None:
        told = extension.with_metrics(job.ckpt.checkpoint(job.step), {_WRITE_TO: job.tmp})
        if job.in_process:
            write_checkpoint_file(told, allow_pickle=job.allow_pickle)
            return
        parts = extension.stored_parts(told)
        proc = self._process(job.ckpt, job.allow_pickle)
        try:
            proc.validate(job.step, parts.name, parts.manifest, timeout_s=job.ckpt.config.timeout_s,
                          abandoned=lambda: self._closing)
        except extension.SideProcessFailed as e:
            if e.crashed:  # the next file gets a new process
                self._procs.pop(job.ckpt.url, None)
            cause = e.__cause__ if e.__cause__ is not None else e
            add_note(cause, f"mpckpt: while writing the Lightning checkpoint of step {job.step} ({e})")
            raise cause from None

    def warm(self, ckpt: Any, allow_pickle: bool) -> None:
        """Start the process that writes the files of ``ckpt``'s root now (on the thread), so that
        its start (imports: seconds) overlaps training instead of delaying the first file."""
        self.call(lambda: self._process(ckpt, allow_pickle) and None)

    def _process(self, ckpt: Any, allow_pickle: bool) -> Any:
        proc = self._procs.get(ckpt.url)
        if proc is None:
            proc = extension.side_process(ckpt, functools.partial(write_checkpoint_file, allow_pickle=allow_pickle))
            self._procs[ckpt.url] = proc
        return proc


def replace(tmp: str, path: str) -> None:
    """``tmp`` becomes ``path`` at once (a rename in the same folder; a move on object stores)."""
    if is_url(path):
        fs, p = fs_of(path)
        fs.mv(fs_of(tmp)[1], p)
        return
    os.replace(tmp, path)


def to_location(state: dict[str, Any], map_location: Any) -> dict[str, Any]:
    """Tensors moved to ``map_location`` when it names a device (mpckpt loads onto the CPU)."""
    import torch

    if map_location is None or callable(map_location) or isinstance(map_location, Mapping):
        return state
    device = torch.device(map_location)
    if device.type == "cpu":
        return state

    def move(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.to(device)
        if isinstance(x, dict):
            return type(x)((k, move(v)) for k, v in x.items()) if type(x) is not dict else {k: move(v) for k, v in
                                                                                              x.items()}
        if isinstance(x, list):
            return [move(v) for v in x]
        return x

    return move(state)  # type: ignore[no-any-return]
