"""The local backend's walk below its root: every path opened one component at a time, no link followed.

This module owns how ``LocalBackend`` reaches a path under its root: ``RootWalk`` opens the
root (which may be a link the user chose), then each folder below it ``O_NOFOLLOW`` relative
to the one above, and turns a failure on the way into the right error of the ``mpckpt.errors``
tree (not found, a refusal of the wrong kind of file, a staging folder removed meanwhile). It
also opens and stats regular files for the read side. ``LocalBackend`` inherits it and decides
what to write, commit and delete; the descriptor-level helpers live in ``_localfs.py``.

INVARIANT: nothing below the root is reached through a symbolic link. Whoever can write into
the root (or a crash, or bit rot) may leave links, folders, FIFOs or huge files where mpckpt
expects its own, so each path is walked one component at a time from the open root folder
(``dir_fd`` + ``O_NOFOLLOW``; the root itself may be a link the user chose). Reads open only
regular files (``O_NONBLOCK`` so a FIFO never blocks, then ``fstat``) and say nothing about
where a link points; writes create a fresh file (``O_EXCL``), unlinking what was there (a
partial file, a planted link or hard link) rather than writing through it; deletions unlink a
link itself, never its target, and remove folders without following links or opening FIFOs.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from collections.abc import Iterator

from mpckpt.errors import CheckpointNotFoundError, StorageError
from mpckpt.storage._localfs import (
    DIR_FLAGS,
    NOT_THERE,
    READ_FLAGS,
    ROOT_FLAGS,
    kind,
    lstat,
    refused,
    storage_error,
)
from mpckpt.storage.base import check_relpath

STAGING_PREFIX = ".tmp."


class RootWalk:
    """Paths below ``root`` reached descriptor by descriptor, never through a link."""

    root: str  # absolute; set by the subclass

    def _abs(self, relpath: str) -> str:
        return os.path.join(self.root, check_relpath(relpath))

    # -- walking below the root without following links -------------------------------------
    def _open_root(self, *, create: bool = False) -> int:
        try:
            if create:
                os.makedirs(self.root, exist_ok=True)
            return os.open(self.root, ROOT_FLAGS)
        except FileNotFoundError as e:
            raise CheckpointNotFoundError(f"checkpoint root {self.root} does not exist") from e
        except NotADirectoryError as e:
            raise StorageError(f"checkpoint root {self.root} is not a folder") from e
        except OSError as e:
            raise storage_error(e, f"cannot open checkpoint root {self.root}") from e

    @contextlib.contextmanager
    def _parent(self, relpath: str, *, create: bool = False,
                create_staging: bool = False) -> Iterator[tuple[int, str]]:
        """The open folder holding ``relpath``'s last component, and that component's name.

        Each folder is opened ``O_NOFOLLOW`` relative to the one above it, so a link anywhere
        below the root is refused, whatever happens to the paths meanwhile. With ``create``,
        missing folders are made (``mkdir`` never follows a link; one in the way is refused
        when it is opened), except a staging folder (top level), which only ``create_staging``
        (``prepare_staging``, in the training process) makes: an uploader never brings one back.
        """
        parts = check_relpath(relpath).split("/")
        fd = self._open_root(create=create)
        try:
            for i, part in enumerate(parts[:-1]):
                shown = os.path.join(self.root, *parts[:i + 1])
                if create and (create_staging or not (i == 0 and part.startswith(STAGING_PREFIX))):
                    try:
                        os.mkdir(part, 0o755, dir_fd=fd)
                        if not parts[0].startswith(STAGING_PREFIX):  # (commit syncs a staging tree)
                            os.fsync(fd)  # shared/: its entry survives a power cut before any commit
                    except FileExistsError:
                        pass
                    except OSError as e:
                        raise storage_error(e, f"cannot create {shown}") from e
                try:
                    child = os.open(part, DIR_FLAGS, dir_fd=fd)
                except OSError as e:
                    raise self._open_error(e, fd, part, shown, expected="a folder", writing=create,
                                           full=self._abs(relpath)) from e
                os.close(fd)
                fd = child
            yield fd, parts[-1]
        finally:
            os.close(fd)

    def _open_error(self, e: OSError, parent: int, name: str, shown: str, *, expected: str,
                    writing: bool, full: str | None = None) -> Exception:
        """The error for failing to open ``name`` (at ``shown``) on the way to ``full``."""
        st = lstat(name, parent) if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.EISDIR, errno.ENXIO) else None
        if st is not None and (stat.S_ISLNK(st.st_mode) or expected != "a folder"):
            return refused(shown, st.st_mode, expected=expected, writing=writing)
        if writing and shown.startswith(os.path.join(self.root, STAGING_PREFIX)) and e.errno == errno.ENOENT:
            return StorageError(f"{shown} no longer exists (the checkpoint was aborted or cleaned up)")
        if e.errno in NOT_THERE and not writing:
            full = full or shown
            why = (f" ({shown} is {kind(st.st_mode)}, not a folder)" if st is not None
                   else f" (there is no {shown})" if full != shown else "")
            return CheckpointNotFoundError(f"{full} does not exist{why}")
        return storage_error(e, f"cannot open {shown}")

    def _open_file(self, relpath: str) -> tuple[int, os.stat_result]:
        """An fd of the regular file at ``relpath`` (never a link, FIFO or folder) and its stat."""
        path = self._abs(relpath)
        with self._parent(relpath) as (parent, name):
            try:
                fd = os.open(name, READ_FLAGS, dir_fd=parent)  # O_NONBLOCK: a FIFO never blocks
            except OSError as e:
                raise self._open_error(e, parent, name, path, expected="a regular file", writing=False) from e
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise refused(path, st.st_mode, expected="a regular file", writing=False)
            fcntl.fcntl(fd, fcntl.F_SETFL, 0)  # a regular file: blocking reads from here on
        except BaseException:
            os.close(fd)
            raise
        return fd, st

    def _stat_file(self, relpath: str) -> os.stat_result | None:
        """The stat of the regular file at ``relpath``, ``None`` if nothing is there."""
        try:
            with self._parent(relpath) as (parent, name):
                st = os.stat(name, dir_fd=parent, follow_symlinks=False)
        except CheckpointNotFoundError:
            return None
        except OSError as e:
            if e.errno in NOT_THERE:
                return None
            raise storage_error(e, f"cannot stat {self._abs(relpath)}") from e
        if not stat.S_ISREG(st.st_mode):
            raise refused(self._abs(relpath), st.st_mode, expected="a regular file", writing=False)
        return st
