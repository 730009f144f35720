"""Lightning: ``MpckptCheckpointIO``, a ``CheckpointIO`` plugin that saves through mpckpt.

This module owns the mapping between Lightning's checkpoint *files* and mpckpt *steps*, and
nothing else; it imports lightning here and only here (``require``).

``Trainer(plugins=[MpckptCheckpointIO(**checkpointer_options)])``: every ``save_checkpoint``
is one ASYNC ``Checkpointer.save`` (it returns once the state is copied into shared memory;
the uploader processes write it). The file Lightning asked for (``epoch=3-step=400.ckpt``,
``last.ckpt``) becomes a *pointer*: a small JSON file at that path that names the mpckpt root
and the step(s) it stands for. So everything Lightning does with the path itself works as with
``torch.save`` files: ``ModelCheckpoint``'s ``_fs.exists`` (version counters), the listing and
``modified`` times behind ``ckpt_path="last"``, ``save_last="link"`` (a symlink to a pointer),
``best_model_path`` / ``last_model_path`` and ``ckpt_path=PATH``.

The mapping, per file:

* the pointer lists *candidates*, newest first: ``{"root", "step", "save_id"}``. A save adds
  its step in front at once (so the file exists when ``save_checkpoint`` returns); after its
  commit, the older candidates it replaced (a ``last.ckpt`` saved again) are dropped and their
  checkpoints deleted. A crash before the commit leaves the previous candidate, which is what
  the file held before (as an atomic ``torch.save`` would).
* ``save_id`` is a random number stored as the checkpoint's metric ``lightning_save_id``: a
  candidate counts only if the committed checkpoint of its step carries it, so a step number
  that a later run reuses (after a crash) is never mistaken for the one a pointer meant.
* ``remove_checkpoint(path)`` removes the pointer at once and deletes its checkpoints: a
  committed one now (or, if mpckpt refuses because it is the newest while saves are pending,
  as soon as it may), a pending one right after its commit, never racing the save.
* ``load_checkpoint(path)`` waits for a candidate still being saved by this process, then loads
  the newest candidate that is committed (``mpckpt.load``; any rank, no process group needed).
  A path that is not a pointer is loaded with ``torch.load`` (checkpoints from before mpckpt).

mpckpt steps are a counter per root (two saves at one global step are two checkpoints, as
two files would be); the checkpoint's metrics carry ``lightning_global_step`` and
``lightning_epoch`` (``mpckpt ls`` shows them). The default root is ``.mpckpt`` inside the
checkpoint's folder (one root per ``ModelCheckpoint`` dirpath); ``root=`` sends every save to
one root (a URL too). Lightning 2.x calls the plugin on global rank 0 only (DDP, and FSDP /
ModelParallel with full state dicts; their sharded checkpoints bypass ``CheckpointIO``), so the
Checkpointer is opened with ``process_group=False`` on the rank that saves; every rank loads.

``teardown()`` (end of fit/validate/test) waits for every pending commit, finishes the
pointers and deletions, closes the Checkpointers and raises what failed; a background failure
is also raised by the next ``save_checkpoint`` / ``remove_checkpoint`` / ``load_checkpoint``.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mpckpt.integrations import require

_lightning = require("lightning", "lightning")

from lightning.fabric.plugins import CheckpointIO  # noqa: E402
from lightning.fabric.utilities.cloud_io import get_filesystem  # noqa: E402

import mpckpt  # noqa: E402
from mpckpt.config import UploadMode  # noqa: E402
from mpckpt.errors import CheckpointNotFoundError, ConfigError, StepOrderError, add_note  # noqa: E402

__all__ = ["MpckptCheckpointIO", "read_pointer"]

log = logging.getLogger("mpckpt")

POINTER_KEY = "mpckpt_lightning"
POINTER_VERSION = 1
DEFAULT_ROOT_NAME = ".mpckpt"
SAVE_ID_METRIC = "lightning_save_id"
# options that would fight what Lightning decides (what to keep, when to save, who saves)
_REFUSED = ("keep", "keep_last", "trigger", "read_only", "process_group")


@dataclass
class _Candidate:
    root: str       # as resolved for this process (absolute path or URL)
    step: int
    save_id: int


@dataclass
class _Pending:
    path: str
    cand: _Candidate
    future: Any     # mpckpt.SaveFuture


def _is_url(text: str) -> bool:
    return "://" in text


def _join(folder: str, name: str) -> str:
    return f"{folder.rstrip('/')}/{name}" if _is_url(folder) else os.path.join(folder, name)


def _dirname(path: str) -> str:
    return path.rstrip("/").rpartition("/")[0] if _is_url(path) else os.path.dirname(path)


def read_pointer(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The pointer at ``path`` as stored (``root`` as written), or None when ``path`` is not one."""
    text = os.fspath(path)
    fs = get_filesystem(text)
    if not fs.exists(text) or fs.isdir(text):
        return None
    with fs.open(text, "rb") as f:
        head = f.read(1 << 20)
    if not head.lstrip().startswith(b"{"):
        return None
    try:
        data = json.loads(head)
    except ValueError:
        return None
    return data if isinstance(data, dict) and data.get(POINTER_KEY) == POINTER_VERSION else None


class MpckptCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` that saves asynchronously through ``mpckpt.Checkpointer``.

    ``root``: where the checkpoints go (a folder or URL); default ``<checkpoint folder>/.mpckpt``.
    Every other keyword goes to ``mpckpt.Checkpointer`` (``memory_budget``, ``workers``,
    ``overlap``, ``storage_options``, ``allow_pickle``, ``timeout_s`` ...); ``keep``,
    ``keep_last``, ``trigger``, ``read_only`` and ``process_group`` are refused: Lightning's
    ``ModelCheckpoint`` decides what to keep and when to save, and the plugin who saves.
    """

    def __init__(self, root: str | os.PathLike[str] | None = None, **checkpointer_options: Any) -> None:
        refused = [name for name in _REFUSED if name in checkpointer_options]
        if refused:
            raise ConfigError(f"MpckptCheckpointIO does not take {', '.join(refused)}: ModelCheckpoint(save_top_k=..., "
                              "every_n_train_steps=...) decides what to keep and when to save, and Lightning which "
                              "rank saves")
        self.root = None if root is None else (os.fspath(root) if _is_url(os.fspath(root))
                                               else os.path.abspath(os.fspath(root)))
        self.options = dict(checkpointer_options)
        self._open: dict[str, mpckpt.Checkpointer] = {}
        self._next_step: dict[str, int] = {}
        self._paths: dict[str, list[_Candidate]] = {}   # pointer files this process wrote, as written
        self._pending: list[_Pending] = []              # in save order (mpckpt commits in that order)
        self._doomed: set[tuple[str, int]] = set()      # pending saves whose file was removed meanwhile
        self._deletions: list[tuple[str, int]] = []     # committed checkpoints to delete when mpckpt lets us
        self.stats: dict[str, mpckpt.CheckpointerStats] = {}  # per root: every save's figures (kept after close)

    # -- Lightning's CheckpointIO --------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Snapshot ``checkpoint`` (ASYNC: returns after mpckpt's copy) and point ``path`` at it."""
        if storage_options is not None:
            raise TypeError("MpckptCheckpointIO.save_checkpoint takes no storage_options; pass them once as "
                            "MpckptCheckpointIO(storage_options=...) (they go to the mpckpt root)")
        self._settle(wait=False)
        path = self._norm(path)
        root = self._root_for(path)
        fresh = root not in self._open
        ckpt = self._writer(root)
        step = self._next_step[root]
        cand = _Candidate(root, step, secrets.randbits(48))  # never the user's `random` state
        metrics = {SAVE_ID_METRIC: cand.save_id}
        for key, name in (("global_step", "lightning_global_step"), ("epoch", "lightning_epoch")):
            value = checkpoint.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                metrics[name] = value
        try:
            if fresh:  # both slabs made now, so later saves only copy (the first save pays for them)
                ckpt.prepare(checkpoint)
            future = ckpt.save(step, checkpoint, metrics=metrics, mode=UploadMode.ASYNC)
        except BaseException as e:
            add_note(e, f"mpckpt: while saving Lightning checkpoint {path} as step {step} of {root}")
            raise
        self._next_step[root] = step + 1
        assert future is not None  # no trigger: every save saves
        self._pending.append(_Pending(path, cand, future))
        self._write_pointer(path, [cand, *self._candidates(path)], checkpoint)

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """The state ``path`` points at (waiting for it if this process is still saving it)."""
        self._settle(wait=False)
        text = self._norm(path)
        fs = get_filesystem(text)
        if not fs.exists(text):
            raise FileNotFoundError(f"Checkpoint file not found: {text}")
        pointer = read_pointer(text)
        if pointer is None:  # a torch.save checkpoint (written before switching to mpckpt)
            import torch

            with fs.open(text, "rb") as f:
                return torch.load(f, map_location=map_location,  # type: ignore[no-any-return]
                                  weights_only=True if weights_only is None else weights_only)
        tried = []
        for cand in self._parse(text, pointer):
            state = self._load_candidate(cand)
            if state is not None:
                return _to_location(state, map_location)
            tried.append(f"step {cand.step} of {cand.root}")
        raise FileNotFoundError(f"{text} points at no committed mpckpt checkpoint (tried {', '.join(tried) or 'none'}): "
                                "its save never committed (the run stopped before) or the checkpoint was deleted")

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the pointer now; delete its checkpoints now if committed, else right after their commit."""
        self._settle(wait=False)
        text = self._norm(path)
        if not _is_url(text) and os.path.islink(text):  # save_last="link": the link only, never its target
            os.remove(text)
            return
        cands = self._candidates(text)
        fs = get_filesystem(text)
        if fs.exists(text):
            fs.rm(text)
        self._paths.pop(text, None)
        for cand in cands:
            self._drop(cand)
        self._delete_what_we_may()

    def teardown(self) -> None:
        """Wait for every pending commit, finish pointers and deletions, close; raise what failed."""
        first: BaseException | None = None
        try:
            self._settle(wait=True)
        except BaseException as e:  # still finish the others and close
            first = e
            try:
                self._settle(wait=True)
            except BaseException:
                pass
        for root, ckpt in list(self._open.items()):
            try:
                ckpt.close()
            except BaseException as e:
                first = first or e
            self._open.pop(root, None)
        if first is not None:
            raise first

    # -- the mapping --------------------------------------------------------------------------
    @staticmethod
    def _norm(path: Any) -> str:
        text = os.fspath(path)
        return text if _is_url(text) else os.path.abspath(text)

    def _root_for(self, path: str) -> str:
        return self.root if self.root is not None else _join(_dirname(path), DEFAULT_ROOT_NAME)

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

    def _candidates(self, path: str) -> list[_Candidate]:
        if path in self._paths:
            return list(self._paths[path])
        pointer = read_pointer(path)
        return [] if pointer is None else self._parse(path, pointer)

    @staticmethod
    def _parse(path: str, pointer: Mapping[str, Any]) -> list[_Candidate]:
        where = _dirname(os.path.realpath(path) if not _is_url(path) else path)
        out = []
        for c in pointer.get("candidates", []):
            root = str(c["root"])
            if not _is_url(root) and not os.path.isabs(root):
                root = os.path.normpath(os.path.join(where, root))
            out.append(_Candidate(root, int(c["step"]), int(c["save_id"])))
        return out

    def _write_pointer(self, path: str, cands: list[_Candidate], checkpoint: Mapping[str, Any] | None = None) -> None:
        fs = get_filesystem(path)
        if not cands:
            if fs.exists(path):
                fs.rm(path)
            self._paths.pop(path, None)
            return
        self._paths[path] = list(cands)
        where = _dirname(path)
        entries = []
        for c in cands:
            root = c.root
            if not _is_url(root) and not _is_url(path) and os.path.dirname(root) == where:
                root = os.path.relpath(root, where)  # the folder stays movable
            entries.append({"root": root, "step": c.step, "save_id": c.save_id})
        body: dict[str, Any] = {POINTER_KEY: POINTER_VERSION, "candidates": entries}
        if checkpoint is not None:
            body.update({k: checkpoint[k] for k in ("epoch", "global_step") if isinstance(checkpoint.get(k), int)})
        else:
            previous = read_pointer(path) or {}
            body.update({k: previous[k] for k in ("epoch", "global_step") if k in previous})
        data = json.dumps(body, indent=1).encode()
        if _is_url(path):
            fs.makedirs(where, exist_ok=True)
            fs.pipe_file(path, data)
            return
        os.makedirs(where, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)  # whole or not at all; a symlink to it (save_last="link") follows

    def _load_candidate(self, cand: _Candidate) -> dict[str, Any] | None:
        pending = next((p for p in self._pending if p.cand == cand), None)
        if pending is not None:  # ours, still being saved: wait for its commit (raises if it failed)
            pending.future.result()
            self._settle(wait=False)
        ckpt = self._open.get(cand.root)
        reader = ckpt if ckpt is not None else None
        try:
            if reader is None:
                if not _is_url(cand.root) and not os.path.isdir(cand.root):
                    return None
                reader = mpckpt.Checkpointer(cand.root, read_only=True,
                                             **{k: v for k, v in self.options.items()
                                                if k in ("storage_options", "allow_pickle", "timeout_s")})
            try:
                metrics = reader.checkpoint(cand.step).metrics
            except CheckpointNotFoundError:
                return None
            if metrics.get(SAVE_ID_METRIC) != cand.save_id:
                return None  # that step number was saved again by a later run: not this file's checkpoint
            state = reader.load(cand.step)
        finally:
            if reader is not None and reader is not ckpt:
                reader.close()
        if not isinstance(state, dict):
            raise ConfigError(f"step {cand.step} of {cand.root} does not hold a Lightning checkpoint dict")
        return state

    def _drop(self, cand: _Candidate) -> None:
        """A checkpoint no file points at any more: delete it once mpckpt lets us."""
        if any(p.cand == cand for p in self._pending):
            self._doomed.add((cand.root, cand.step))
        else:
            self._deletions.append((cand.root, cand.step))

    def _settle(self, wait: bool) -> None:
        """Finish what committed saves make due (pointers, deletions); raise the first failure."""
        failure: BaseException | None = None
        while self._pending:
            p = self._pending[0]
            if not wait and not p.future.done():
                break
            self._pending.pop(0)
            try:
                p.future.result()
            except BaseException as e:
                add_note(e, f"mpckpt: the Lightning checkpoint {p.path} (step {p.cand.step} of {p.cand.root}) "
                            "was not saved")
                failure = failure or e
                self._forget(p)
                continue
            self._committed(p)
        if wait:
            for ckpt in self._open.values():
                ckpt.wait()
        self._delete_what_we_may()
        if failure is not None:
            raise failure

    def _forget(self, p: _Pending) -> None:
        """A save that failed: its file falls back to what it pointed at before."""
        self._doomed.discard((p.cand.root, p.cand.step))
        if p.path in self._paths and p.cand in self._paths[p.path]:
            self._write_pointer(p.path, [c for c in self._paths[p.path] if c != p.cand])

    def _committed(self, p: _Pending) -> None:
        key = (p.cand.root, p.cand.step)
        if key in self._doomed:  # its file was removed while it was saved
            self._doomed.discard(key)
            self._deletions.append(key)
            return
        cands = self._paths.get(p.path)
        if cands is None or p.cand not in cands:
            return
        i = cands.index(p.cand)
        for old in cands[i + 1:]:  # what this save replaced (last.ckpt saved again)
            self._drop(old)
        # no fsync: a rewrite lost in a power failure leaves the longer list, whose first committed
        # candidate is this same step
        self._write_pointer(p.path, cands[: i + 1])

    def _delete_what_we_may(self) -> None:
        later = []
        for root, step in self._deletions:
            try:
                self._writer(root).delete(step)
            except CheckpointNotFoundError:
                pass  # gone already
            except StepOrderError:
                later.append((root, step))  # the newest while saves are pending: after the next commit
        self._deletions = later


def _to_location(state: dict[str, Any], map_location: Any) -> dict[str, Any]:
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
