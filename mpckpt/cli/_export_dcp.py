"""``mpckpt export ROOT [STEP|latest] --to DIR --format dcp``: one checkpoint as a plain
torch.distributed.checkpoint (DCP) folder.

``export`` loads the state as ``mpckpt.load`` loads it (every file verified; a checkpoint saved
by the ranks of a job is joined, every DTensor whole) and this module writes it by DCP's own
``FileSystemWriter`` (``.metadata`` and one ``.distcp`` file, each tensor one chunk), so that
``dcp.load(state_dict, checkpoint_id=DIR)`` reads it into a live state, unsharded or sharded
(DCP's planner reads each rank's part of the whole tensors), and DCP's converters
(``dcp_to_torch_save``) and torchtitan pick it up. Its keys are the state's dotted paths, as
``dcp.save`` of the same nested state would make them (``model.0.weight``,
``optim.state.0.exp_avg``); ``--prefix`` exports one part of the state, as for a file.

INVARIANT: DIR appears whole or not at all: the folder is written under a temporary name
beside it, then renamed into place. An existing DIR that is not an empty folder is refused
(status 2), whatever ``--force`` says: a DCP folder is never merged into or replaced.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Any

from mpckpt._futures import size_text
from mpckpt.cli._common import BadArguments, fsync_path, say, state_items
from mpckpt.errors import MpckptError


def check_target(target: Path) -> None:
    """``BadArguments`` unless ``target`` is a new or empty folder in a folder that exists."""
    if target.is_dir():
        if any(target.iterdir()):
            raise BadArguments(f"--to {target} is a folder that is not empty; a DCP folder is never written into "
                               "another or over one: name a new or empty folder")
    elif target.exists() or target.is_symlink():
        raise BadArguments(f"--to {target} exists and is not a folder; name a new or empty folder")
    if not target.absolute().parent.is_dir():
        raise BadArguments(f"--to {target}: the folder {target.absolute().parent} does not exist")


def write(target: Path, state: Any, *, what: str) -> None:
    """``state`` (``what``: the step and part, for messages) as a DCP folder at ``target``."""
    import torch

    if not isinstance(state, dict):
        raise BadArguments(f"{what} is a {type(state).__name__}; a DCP folder holds a dict (give a --prefix that "
                           "names one)")
    tensors = [v for _, v in state_items(state) if isinstance(v, torch.Tensor)]
    _write(target, state)
    size = sum(t.numel() * t.element_size() for t in tensors)
    say(f"wrote {target}: {what} as a DCP folder, {len(tensors)} tensors ({size_text(size)}); "
        f"dcp.load(state_dict, checkpoint_id={str(target)!r}) reads it")


def _write(target: Path, state: dict[str, Any]) -> None:
    """``state`` as a DCP folder at ``target``: written beside it, then renamed into place."""
    import torch.distributed.checkpoint as dcp

    tmp = target.absolute().parent / f".{target.name}.mpckpt-export-{os.getpid()}"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # DCP's notes on running without a process group
            dcp.save(state, storage_writer=_writer(tmp, final=target.absolute()), no_dist=True)
        try:
            os.rename(tmp, target)  # INVARIANT: onto nothing or an empty folder only; never over a DCP folder
        except OSError as e:
            raise BadArguments(f"--to {target}: cannot put the folder in place ({e}); name a new or empty "
                               "folder") from e
        fsync_path(target.absolute().parent)
    except (OSError, ValueError, TypeError, RuntimeError) as e:
        raise MpckptError(f"cannot write {target}: {type(e).__name__}: {str(e)[:500]}") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _writer(path: Path, *, final: Path) -> Any:
    """DCP's ``FileSystemWriter`` on ``path`` whose metadata names ``final`` (a string: no class
    beyond DCP's own is pickled) as its checkpoint id."""
    from torch.distributed.checkpoint import FileSystemWriter

    class Writer(FileSystemWriter):
        def storage_meta(self) -> Any:
            meta = super().storage_meta()
            if meta is not None:
                meta.checkpoint_id = str(final)
            return meta

    return Writer(path, single_file_per_rank=True, sync_files=True)
