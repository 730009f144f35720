"""Local-disk backend: direct writes from shared memory, fsync, atomic folder rename.

Commit protocol (POSIX): files are written into ``.tmp.<name>.<pid>.<token>/`` beside the
destination and fsynced; ``commit`` writes ``manifest.json`` there, fsyncs it and the folder,
renames the folder to ``<name>`` (which fails rather than replace a non-empty folder) and
fsyncs the root so the rename itself survives a power cut.

The single-writer lock is an ``flock`` on ``<root>/.mpckpt.lock``: the kernel drops it when
its process dies, so a crashed trainer never blocks the next one.

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
import secrets
import shutil
import stat
from collections.abc import Iterator, Sequence

from mpckpt.errors import (
    CheckpointNotFoundError,
    CommitConflictError,
    ConfigError,
    CorruptCheckpointError,
    LockedError,
    StorageError,
    StorageFullError,
)
from mpckpt.storage.base import MANIFEST_NAME, BackendSpec, Buffer, check_relpath

STAGING_PREFIX = ".tmp."
LOCK_NAME = ".mpckpt.lock"
_WRITE_CHUNK = 1 << 30  # below Linux's 2 GiB per-write cap
_BLOCK = 4096
_DIRECT_MIN = 1 << 20  # below this, buffered writes are as cheap
_ROOT_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC  # follows a link: the user chose the root
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_NO_LINKS = "mpckpt never follows links inside a checkpoint root"
_NOT_THERE = (errno.ENOENT, errno.ENOTDIR, errno.ENAMETOOLONG)
_LOCK_KIND = "its lock file (a regular file)"


def _storage_error(e: OSError, what: str) -> StorageError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return StorageFullError(f"{what}: {e.strerror} (errno {e.errno}); free space and save again")
    return StorageError(f"{what}: {e.strerror or e}")


_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"),
          (stat.S_ISREG, "a regular file"))


def _kind(mode: int) -> str:
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def _refused(path: str, mode: int, *, expected: str, writing: bool) -> StorageError | CorruptCheckpointError:
    """The error for ``path`` being of the wrong kind: never a word about where a link points."""
    if stat.S_ISLNK(mode):
        message = f"{path} is a symbolic link; {_NO_LINKS}: remove the link"
    else:
        message = f"{path} is {_kind(mode)} where mpckpt expects {expected}; remove it"
    return StorageError(message) if writing else CorruptCheckpointError(message, path=path)


def _lstat(name: str, dir_fd: int) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return None


def _pwrite_all(fd: int, view: memoryview, offset: int) -> int:
    pos = 0
    while pos < len(view):
        pos += os.pwrite(fd, view[pos:pos + _WRITE_CHUNK], offset + pos)
    return pos


def _read_all(fd: int, size: int, max_bytes: int | None, path: str) -> bytes:
    """The file to its end (one read if ``size`` is right); never more than ``max_bytes``."""
    parts: list[bytes] = []
    total = 0
    while chunk := os.read(fd, min(_WRITE_CHUNK, max(size - total, 1 << 16) + 1,
                                   _WRITE_CHUNK if max_bytes is None else max_bytes + 1 - total)):
        parts.append(chunk)
        total += len(chunk)
        if max_bytes is not None and total > max_bytes:
            raise CorruptCheckpointError(f"{path} grew past {max_bytes} bytes while it was read; "
                                         "it is damaged or not written by mpckpt", path=path)
    return b"".join(parts)


def _remove_tree(parent: int, name: str) -> None:
    """``rm -r`` of folder ``name`` in the folder ``parent``, descriptor by descriptor.

    Never follows a link (a link is unlinked) and never blocks on a FIFO (``O_NONBLOCK``).
    Tries everything, then raises the first ``OSError`` it met.
    """
    first: OSError | None = None
    folder = os.open(name, _DIR_FLAGS, dir_fd=parent)  # ENOTDIR if a link or a file is there now
    try:
        with os.scandir(folder) as it:
            entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
        for entry, is_dir in entries:
            try:
                _remove_tree(folder, entry) if is_dir else os.unlink(entry, dir_fd=folder)
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


class _FlockLock:
    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    def renew(self) -> None:
        return None

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


class LocalBackend:
    """Checkpoints in a folder of the local filesystem."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.url = self.root
        self.direct_io = os.environ.get("MPCKPT_DIRECT_IO", "1") != "0" and hasattr(os, "O_DIRECT")

    def spec(self) -> BackendSpec:
        return BackendSpec("file", self.root, {})

    def _abs(self, relpath: str) -> str:
        return os.path.join(self.root, check_relpath(relpath))

    # -- walking below the root without following links -------------------------------------
    def _open_root(self, *, create: bool = False) -> int:
        try:
            if create:
                os.makedirs(self.root, exist_ok=True)
            return os.open(self.root, _ROOT_FLAGS)
        except FileNotFoundError as e:
            raise CheckpointNotFoundError(f"checkpoint root {self.root} does not exist") from e
        except NotADirectoryError as e:
            raise StorageError(f"checkpoint root {self.root} is not a folder") from e
        except OSError as e:
            raise _storage_error(e, f"cannot open checkpoint root {self.root}") from e

    @contextlib.contextmanager
    def _parent(self, relpath: str, *, create: bool = False) -> Iterator[tuple[int, str]]:
        """The open folder holding ``relpath``'s last component, and that component's name.

        Each folder is opened ``O_NOFOLLOW`` relative to the one above it, so a link anywhere
        below the root is refused, whatever happens to the paths meanwhile. With ``create``,
        missing folders are made; a staging folder (top level) is never brought back.
        """
        parts = check_relpath(relpath).split("/")
        fd = self._open_root(create=create)
        try:
            for i, part in enumerate(parts[:-1]):
                shown = os.path.join(self.root, *parts[:i + 1])
                if create and not (i == 0 and part.startswith(STAGING_PREFIX)):
                    try:
                        os.mkdir(part, 0o755, dir_fd=fd)
                    except FileExistsError:
                        pass
                    except OSError as e:
                        raise _storage_error(e, f"cannot create {shown}") from e
                try:
                    child = os.open(part, _DIR_FLAGS, dir_fd=fd)
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
        st = _lstat(name, parent) if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.EISDIR, errno.ENXIO) else None
        if st is not None and (stat.S_ISLNK(st.st_mode) or expected != "a folder"):
            return _refused(shown, st.st_mode, expected=expected, writing=writing)
        if writing and shown.startswith(os.path.join(self.root, STAGING_PREFIX)) and e.errno == errno.ENOENT:
            return StorageError(f"{shown} no longer exists (the checkpoint was aborted or cleaned up)")
        if e.errno in _NOT_THERE and not writing:
            full = full or shown
            why = (f" ({shown} is {_kind(st.st_mode)}, not a folder)" if st is not None
                   else f" (there is no {shown})" if full != shown else "")
            return CheckpointNotFoundError(f"{full} does not exist{why}")
        return _storage_error(e, f"cannot open {shown}")

    def _open_file(self, relpath: str) -> tuple[int, os.stat_result]:
        """An fd of the regular file at ``relpath`` (never a link, FIFO or folder) and its stat."""
        path = self._abs(relpath)
        with self._parent(relpath) as (parent, name):
            try:
                fd = os.open(name, _READ_FLAGS, dir_fd=parent)  # O_NONBLOCK: a FIFO never blocks
            except OSError as e:
                raise self._open_error(e, parent, name, path, expected="a regular file", writing=False) from e
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise _refused(path, st.st_mode, expected="a regular file", writing=False)
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
            if e.errno in _NOT_THERE:
                return None
            raise _storage_error(e, f"cannot stat {self._abs(relpath)}") from e
        if not stat.S_ISREG(st.st_mode):
            raise _refused(self._abs(relpath), st.st_mode, expected="a regular file", writing=False)
        return st

    # -- set-up --------------------------------------------------------------------------
    def check_writable(self) -> None:
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"checkpoint root {self.root} cannot be created: {e.strerror}; "
                              "choose a folder you can write to") from e
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise ConfigError(f"checkpoint root {self.root} is not writable; choose a folder you can write to")

    def acquire_writer_lock(self, owner: str) -> _FlockLock:
        path = os.path.join(self.root, LOCK_NAME)
        root = self._open_root()  # a missing root is an error here: gc creates nothing
        try:
            fd = os.open(LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         0o644, dir_fd=root)
        except OSError as e:
            raise self._open_error(e, root, LOCK_NAME, path, expected=_LOCK_KIND, writing=True) from e
        finally:
            os.close(root)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise _refused(path, st.st_mode, expected=_LOCK_KIND, writing=True)
            if st.st_nlink > 1:  # a hard link to someone's file: truncating it would destroy that file
                raise StorageError(f"{path} has {st.st_nlink} hard links; mpckpt writes its lock file only "
                                   "when it is a file of its own: remove it")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as e:
                holder = os.pread(fd, 256, 0).decode(errors="replace").strip()
                raise LockedError(f"{self.root} is being written by another live process ({holder or 'unknown'}); "
                                  "use a different folder or stop the other writer") from e
            os.ftruncate(fd, 0)
            os.pwrite(fd, owner.encode(), 0)
        except BaseException as e:
            os.close(fd)
            if isinstance(e, OSError):
                raise _storage_error(e, f"cannot take the lock {path}") from e
            raise
        return _FlockLock(fd)

    # -- writing ------------------------------------------------------------------------
    def stage(self, name: str) -> str:
        name = _top_level(name)
        staging = f"{STAGING_PREFIX}{name}.{os.getpid()}.{secrets.token_hex(4)}"
        root = self._open_root(create=True)
        try:
            self._refuse_committed(root, name)
            os.mkdir(staging, 0o755, dir_fd=root)
        except OSError as e:
            raise _storage_error(e, f"cannot create staging folder in {self.root}") from e
        finally:
            os.close(root)
        return staging

    def _refuse_committed(self, root: int, name: str) -> None:
        """``CommitConflictError`` if ``name`` is committed, or is anything but a folder of ours."""
        path = os.path.join(self.root, name)
        st = _lstat(name, root)
        if st is None:
            return
        if not stat.S_ISDIR(st.st_mode):
            raise CommitConflictError(f"{path} is {_kind(st.st_mode)}, not a checkpoint folder; {_NO_LINKS} "
                                      "and never replaces what it did not write: remove it to save this step")
        folder = os.open(name, _DIR_FLAGS, dir_fd=root)
        try:
            if _lstat(MANIFEST_NAME, folder) is not None:
                raise CommitConflictError(f"checkpoint {name} already exists in {self.root}; it is never overwritten")
        finally:
            os.close(folder)

    def _create(self, parent: int, name: str, path: str) -> int:
        """A new empty file: whatever is at ``name`` (a partial file, a link) is unlinked, not followed."""
        for _attempt in range(3):
            try:
                return os.open(name, _CREATE_FLAGS, 0o644, dir_fd=parent)
            except FileExistsError:
                st = _lstat(name, parent)
                if st is not None and stat.S_ISDIR(st.st_mode):
                    raise _refused(path, st.st_mode, expected="a file", writing=True) from None
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=parent)
        raise StorageError(f"cannot create {path}: something else keeps creating it")

    def write_file(self, relpath: str, parts: Sequence[Buffer]) -> None:
        path = self._abs(relpath)
        with self._parent(relpath, create=True) as (parent, name):
            try:
                fd = self._create(parent, name, path)
            except OSError as e:
                raise _storage_error(e, f"cannot create {path}") from e
            try:
                offset = 0
                for part in parts:
                    view = memoryview(part).cast("B")
                    done = self._write_direct(parent, name, fd, view, offset) if self.direct_io else 0
                    _pwrite_all(fd, view[done:], offset + done)
                    offset += len(view)
                os.fsync(fd)
            except OSError as e:
                raise _storage_error(e, f"cannot write {path}") from e
            finally:
                os.close(fd)

    def _write_direct(self, parent: int, name: str, fd: int, view: memoryview, offset: int) -> int:
        """Write the block-aligned head of ``view`` with O_DIRECT; return the bytes written.

        Direct I/O sends shared memory to the device without copying it into the page cache,
        so persisting costs training neither a kernel memcpy nor dirty-page writeback. Only
        block-aligned spans qualify (the layout aligns shard data to 4096 in memory and in the
        file); anything else, and filesystems without O_DIRECT (tmpfs), go the buffered way.
        The second descriptor must be the very file ``fd`` created, not what replaced it.
        """
        span = len(view) // _BLOCK * _BLOCK
        if span < _DIRECT_MIN or offset % _BLOCK:
            return 0
        try:
            direct = os.open(name, os.O_WRONLY | os.O_DIRECT | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
        except (OSError, AttributeError):
            self.direct_io = False  # this filesystem refuses it; stop trying
            return 0
        try:
            if not os.path.samestat(os.fstat(direct), os.fstat(fd)):
                raise StorageError(f"{self.root}: {name} was replaced while it was written; "
                                   "something else writes into this checkpoint root")
            return _pwrite_all(direct, view[:span], offset)
        except OSError as e:
            if e.errno != errno.EINVAL:  # EINVAL: memory not aligned; the rest goes buffered
                raise
            return 0
        finally:
            os.close(direct)

    def upload_file(self, relpath: str, local_path: str) -> None:
        path = self._abs(relpath)
        try:
            src = open(local_path, "rb")  # noqa: SIM115 - closed by the with below
        except FileNotFoundError as e:
            raise CheckpointNotFoundError(f"cannot upload {local_path}: it does not exist") from e
        except OSError as e:
            raise _storage_error(e, f"cannot read {local_path}") from e
        with src, self._parent(relpath, create=True) as (parent, name):
            try:
                with os.fdopen(self._create(parent, name, path), "wb") as dst:
                    shutil.copyfileobj(src, dst, 16 << 20)
                    dst.flush()
                    os.fsync(dst.fileno())
            except OSError as e:
                raise _storage_error(e, f"cannot copy {local_path} to {path}") from e

    def commit(self, staging: str, name: str, manifest: bytes) -> None:
        staging, name = _top_level(staging), _top_level(name)
        # INVARIANT: the manifest is written last, after every data file was fsynced.
        self.write_file(f"{staging}/{MANIFEST_NAME}", [manifest])
        root = self._open_root()
        try:
            for _dirpath, _dirs, _files, folder in os.fwalk(staging, dir_fd=root):  # never follows links
                os.fsync(folder)
            self._refuse_committed(root, name)
            if _lstat(name, root) is not None:  # a manifest-less leftover was never a checkpoint
                _remove_tree(root, name)
            os.rename(staging, name, src_dir_fd=root, dst_dir_fd=root)  # replaces no link, file or full folder
            os.fsync(root)
        except OSError as e:
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                raise CommitConflictError(f"checkpoint {name} appeared in {self.root} while committing") from e
            raise _storage_error(e, f"cannot commit {name} in {self.root}") from e
        finally:
            os.close(root)

    def abort(self, staging: str) -> None:
        staging = check_relpath(staging)
        if "/" not in staging and staging.startswith(STAGING_PREFIX):  # only ever a staging folder
            with contextlib.suppress(CheckpointNotFoundError, OSError), self._parent(staging) as (root, name):
                self._remove(root, name)

    # -- reading ------------------------------------------------------------------------
    def list_names(self) -> list[str]:
        try:
            with os.scandir(self.root) as entries:  # a link is no checkpoint folder, wherever it points
                return sorted(e.name for e in entries if e.is_dir(follow_symlinks=False))
        except FileNotFoundError:
            return []
        except NotADirectoryError as e:
            raise StorageError(f"checkpoint root {self.root} is not a folder") from e
        except OSError as e:
            raise _storage_error(e, f"cannot list {self.root}") from e

    def read_bytes(self, relpath: str, *, max_bytes: int | None = None) -> bytes:
        path = self._abs(relpath)
        fd, st = self._open_file(relpath)
        try:
            if max_bytes is not None and st.st_size > max_bytes:
                raise CorruptCheckpointError(
                    f"{path} is {st.st_size} bytes, more than the {max_bytes} such a file may have; "
                    "it is damaged or not written by mpckpt", path=path)
            return _read_all(fd, st.st_size, max_bytes, path)
        except OSError as e:
            raise _storage_error(e, f"cannot read {path}") from e
        finally:
            os.close(fd)

    def read_into(self, relpath: str, offset: int, out: memoryview) -> None:
        path = self._abs(relpath)
        fd, _st = self._open_file(relpath)
        try:
            view = out.cast("B")
            pos = 0
            while pos < len(view):
                n = os.preadv(fd, [view[pos:pos + _WRITE_CHUNK]], offset + pos)
                if n == 0:
                    raise CorruptCheckpointError(
                        f"{path} is truncated: wanted bytes up to {offset + len(view)}, file ends at {offset + pos}",
                        path=path,
                    )
                pos += n
        except OSError as e:
            raise _storage_error(e, f"cannot read {path}") from e
        finally:
            os.close(fd)

    def size(self, relpath: str) -> int:
        st = self._stat_file(relpath)
        if st is None:
            raise CheckpointNotFoundError(f"{self._abs(relpath)} does not exist")
        return st.st_size

    def exists(self, relpath: str) -> bool:
        return self._stat_file(relpath) is not None

    # -- housekeeping -------------------------------------------------------------------
    def delete(self, name: str) -> None:
        try:
            with self._parent(name) as (parent, last):
                self._remove(parent, last)
        except CheckpointNotFoundError:
            return  # a folder above it is missing: nothing to delete
        except OSError as e:
            raise _storage_error(e, f"cannot delete {self._abs(name)}") from e

    @staticmethod
    def _remove(parent: int, name: str) -> None:
        """Remove folder ``name``, manifest first; a link only unlinked; anything else left alone."""
        st = _lstat(name, parent)
        if st is None:
            return
        if stat.S_ISLNK(st.st_mode):
            os.unlink(name, dir_fd=parent)  # the link itself, never what it points to
            return
        if not stat.S_ISDIR(st.st_mode):
            return  # not a folder mpckpt wrote: not ours to delete
        try:
            folder = os.open(name, _DIR_FLAGS, dir_fd=parent)
        except OSError:
            return  # replaced since the lstat: not ours to delete either
        try:
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                os.unlink(MANIFEST_NAME, dir_fd=folder)  # stop existing first
        finally:
            os.close(folder)
        with contextlib.suppress(OSError):  # the manifest is gone: leftovers are no checkpoint
            _remove_tree(parent, name)

    def cleanup_incomplete(self) -> list[str]:
        removed = []
        for name in self.list_names():
            if name.startswith(STAGING_PREFIX):
                self.abort(name)
                removed.append(name)
        return removed


def _top_level(name: str) -> str:
    """``name`` if it is a single folder name under the root, else ``ConfigError``."""
    norm = check_relpath(name)
    if "/" in norm:
        raise ConfigError(f"checkpoint name {name!r} must be one folder name, without '/'")
    return norm
