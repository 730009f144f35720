"""Descriptor-level file operations of the local backend, none of which follows a link.

This module owns the low-level half of the local backend: the open flags (``O_NOFOLLOW`` on every
component below the root, ``O_NONBLOCK`` so a FIFO never blocks a read), the translation of
``OSError`` into the ``mpckpt.errors`` tree and of a wrong kind of file into a refusal that
never says where a link points, creating a fresh file in place of whatever was there (never
writing through it), whole-buffer ``pwrite`` and bounded reads, descriptor-by-descriptor
``rm -r``, and the ``flock`` writer lock. It knows nothing of checkpoints, roots or
commit protocols; ``RootWalk`` (``_localwalk.py``) walks paths, ``LocalBackend`` (``local.py``)
decides, and these helpers only act on descriptors they have opened.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import threading
import weakref

from mpckpt.errors import CorruptCheckpointError, StorageError, StorageFullError

WRITE_CHUNK = 1 << 30  # below Linux's 2 GiB per-write cap
ROOT_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC  # follows a link: the user chose the root
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
NO_LINKS = "mpckpt never follows links inside a checkpoint root"
#: errnos meaning "nothing is at this path" (a component missing, a file where a folder should be)
NOT_THERE = (errno.ENOENT, errno.ENOTDIR, errno.ENAMETOOLONG)

_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"),
          (stat.S_ISREG, "a regular file"))


def storage_error(e: OSError, what: str) -> StorageError:
    """``StorageFullError`` for ENOSPC / quota / too big, else ``StorageError``; ``what`` failed."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return StorageFullError(f"{what}: {e.strerror} (errno {e.errno}); free space and save again")
    return StorageError(f"{what}: {e.strerror or e}")


def kind(mode: int) -> str:
    """What a file of ``mode`` is, in words ("a symbolic link", "a folder" ...)."""
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def refused(path: str, mode: int, *, expected: str, writing: bool) -> StorageError | CorruptCheckpointError:
    """The error for ``path`` being of the wrong kind: never a word about where a link points."""
    if stat.S_ISLNK(mode):
        message = f"{path} is a symbolic link; {NO_LINKS}: remove the link"
    else:
        message = f"{path} is {kind(mode)} where mpckpt expects {expected}; remove it"
    return StorageError(message) if writing else CorruptCheckpointError(message, path=path)


def lstat(name: str, dir_fd: int) -> os.stat_result | None:
    """The stat of ``name`` in folder ``dir_fd`` itself (a link is not followed); ``None`` if absent."""
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return None


def create_file(parent: int, name: str, path: str) -> int:
    """A new empty file: whatever is at ``name`` (a partial file, a link) is unlinked, not followed."""
    for _attempt in range(3):
        try:
            return os.open(name, CREATE_FLAGS, 0o644, dir_fd=parent)
        except FileExistsError:
            st = lstat(name, parent)
            if st is not None and stat.S_ISDIR(st.st_mode):
                raise refused(path, st.st_mode, expected="a file", writing=True) from None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=parent)
    raise StorageError(f"cannot create {path}: something else keeps creating it")


def pwrite_all(fd: int, view: memoryview, offset: int) -> int:
    """Write all of ``view`` at ``offset`` (in chunks below the per-call cap); return its length."""
    pos = 0
    while pos < len(view):
        pos += os.pwrite(fd, view[pos:pos + WRITE_CHUNK], offset + pos)
    return pos


def pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Fill ``view`` with the bytes at ``offset`` (in chunks below the per-call cap); return how many
    were read: fewer than ``len(view)`` only where the file ends first."""
    pos = 0
    while pos < len(view):
        n = os.preadv(fd, [view[pos:pos + WRITE_CHUNK]], offset + pos)  # (releases the GIL)
        if n == 0:
            break
        pos += n
    return pos


def read_all(fd: int, size: int, max_bytes: int | None, path: str) -> bytes:
    """The file to its end (one read if ``size`` is right); never more than ``max_bytes``."""
    parts: list[bytes] = []
    total = 0
    while chunk := os.read(fd, min(WRITE_CHUNK, max(size - total, 1 << 16) + 1,
                                   WRITE_CHUNK if max_bytes is None else max_bytes + 1 - total)):
        parts.append(chunk)
        total += len(chunk)
        if max_bytes is not None and total > max_bytes:
            raise CorruptCheckpointError(f"{path} grew past {max_bytes} bytes while it was read; "
                                         "it is damaged or not written by mpckpt", path=path)
    return b"".join(parts)


def remove_tree(parent: int, name: str) -> None:
    """``rm -r`` of folder ``name`` in the folder ``parent``, descriptor by descriptor.

    Never follows a link (a link is unlinked) and never blocks on a FIFO (``O_NONBLOCK``).
    Tries everything, then raises the first ``OSError`` it met.
    """
    first: OSError | None = None
    folder = os.open(name, DIR_FLAGS, dir_fd=parent)  # ENOTDIR if a link or a file is there now
    try:
        with os.scandir(folder) as it:
            entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
        for entry, is_dir in entries:
            try:
                remove_tree(folder, entry) if is_dir else os.unlink(entry, dir_fd=folder)
            except OSError as e:
                first = first or e
    finally:
        os.close(folder)
    try:
        os.rmdir(name, dir_fd=parent)
    except OSError as e:
        first = first or e
    if first is not None:
        raise first


_held: weakref.WeakSet[FlockLock] = weakref.WeakSet()  # the locks this process holds
_held_guard = threading.Lock()
_fork_hook = False


def _close_in_child() -> None:
    for lock in list(_held):
        if lock._fd is not None:
            with contextlib.suppress(OSError):
                os.close(lock._fd)
            lock._fd = None


class FlockLock:
    """A held ``flock`` on an open lock file; the kernel drops it if the process dies.

    INVARIANT: a fork child closes its copy of the descriptor at once. A flock belongs to the
    open file description, which a fork shares, so a child that outlives its parent (a
    DataLoader worker of a killed trainer) would otherwise keep the root locked; closing one
    descriptor of several never unlocks, and the child can no longer unlock the parent's.
    """

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd
        global _fork_hook
        with _held_guard:
            _held.add(self)
            if not _fork_hook:
                os.register_at_fork(after_in_child=_close_in_child)
                _fork_hook = True

    def renew(self) -> None:
        return None

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
