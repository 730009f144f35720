"""Where ``MpckptCheckpointIO``'s files and roots are: paths (local or fsspec URLs) and the default
root of a checkpoint folder. Needs neither torch nor lightning.

The default root of a folder (``default_root``, ``root_of_folder``) is *beside* it,
``<dirpath>.mpckpt``, so the folder holds Lightning's files only; inside it (``<dirpath>/.mpckpt``)
only where nothing lies beside it (``/``, a bucket) and where an earlier mpckpt saved there: a
root at that old default that holds committed checkpoints stays the folder's root (logged once
per folder and process), so a run saved with it resumes. A step names its file by name when the
root serves the file's folder (``file_metric``: the pair stays movable), by its whole path
otherwise.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import mpckpt
from mpckpt.errors import MpckptError

log = logging.getLogger("mpckpt")


def is_url(text: str) -> bool:
    return "://" in text


def norm(path: Any) -> str:
    text = os.fspath(path)
    return text if is_url(text) else os.path.abspath(text)


def join(folder: str, name: str) -> str:
    return f"{folder.rstrip('/')}/{name}" if is_url(folder) else os.path.join(folder, name)


def dirname(path: str) -> str:
    return path.rstrip("/").rpartition("/")[0] if is_url(path) else os.path.dirname(path)


def fs_of(path: str) -> tuple[Any, str]:
    from fsspec.core import url_to_fs

    return url_to_fs(path)  # type: ignore[no-any-return]


def exists(path: str) -> bool:
    if not is_url(path):
        return os.path.lexists(path)
    fs, p = fs_of(path)
    return bool(fs.exists(p))


def remove(path: str) -> None:
    if not is_url(path):
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
        return
    fs, p = fs_of(path)
    if fs.exists(p):
        fs.rm(p)


# -- the root of a checkpoint folder ------------------------------------------------------------
ROOT_SUFFIX = ".mpckpt"        # the default root: <dirpath>.mpckpt, beside the folder
OLD_ROOT_NAME = ".mpckpt"      # the default root of earlier versions: <dirpath>/.mpckpt, inside it
_ROOTED_SCHEMES = ("file", "local", "memory")  # URLs whose top folder has a parent: not buckets
_told: set[str] = set()        # folders whose old root this process said it keeps using


def default_root(folder: str) -> str:
    """The default root of the Lightning files in ``folder``: beside it, ``<folder>.mpckpt``;
    inside it, ``<folder>/.mpckpt``, where nothing lies beside it (``/``, ``s3://bucket``)."""
    if is_url(folder):
        scheme, _, rest = folder.partition("://")
        rest = rest.strip("/")
        if rest and ("/" in rest or scheme in _ROOTED_SCHEMES):
            return folder.rstrip("/") + ROOT_SUFFIX
        return join(folder, OLD_ROOT_NAME)
    stripped = folder.rstrip(os.sep)
    return stripped + ROOT_SUFFIX if os.path.basename(stripped) else join(folder, OLD_ROOT_NAME)


def root_of_folder(folder: str, **read_options: Any) -> str:
    """The root the files of ``folder`` are saved into when no ``root=`` is given: ``default_root``,
    or ``<folder>/.mpckpt`` when that one holds committed checkpoints (an earlier mpckpt's
    default; ``read_options``: ``storage_options``, ``allow_pickle``, ``timeout_s``)."""
    new, old = default_root(folder), join(folder, OLD_ROOT_NAME)
    if new == old or not (os.path.isdir(old) if not is_url(old) else exists(old)):
        return new
    try:
        with mpckpt.Checkpointer(old, read_only=True, **read_options) as reader:
            held = len(reader.steps())
    except MpckptError as e:  # never silently past a run's checkpoints: its open says why
        log.warning("mpckpt: could not read %s (%s); saving there, not into %s", old, e, new)
        return old
    if not held:
        return new
    if folder not in _told:
        _told.add(folder)
        log.warning("mpckpt: %s holds %d committed checkpoint(s) of this folder (the root inside it, where mpckpt "
                    "put it before): saving there too. New folders get their root beside them (%s); move it "
                    "there once no file of the folder is a pointer (see docs/integrations/lightning.md)",
                    old, held, new)
    return old


def serves(root: str, folder: str) -> bool:
    """Whether ``root`` lies in ``folder`` or is its default root beside it (local paths)."""
    if is_url(root) or is_url(folder):
        return False
    root = root.rstrip(os.sep)
    return os.path.dirname(root) == folder or root == default_root(folder)


def file_metric(root: str, path: str) -> str:
    """How a step names its file: by name when the root serves the file's folder, else by its whole path."""
    if serves(root, dirname(path)):
        return os.path.basename(path)
    return path


def temporary_path(path: str, step: int) -> str:
    """Where the file of ``step`` is written before it is renamed to ``path`` (hidden, same folder)."""
    folder, base = dirname(path), path.rstrip("/").rpartition("/")[2] if is_url(path) else os.path.basename(path)
    return join(folder, f".{base}.{step}.mpckpt-tmp")
