"""Local-disk backend: direct writes from shared memory, fsync, atomic folder rename.

Commit protocol (POSIX): files are written into ``.tmp.<name>.<pid>.<token>/`` beside the
destination and fsynced; ``commit`` writes ``manifest.json`` there, fsyncs it and the folder,
renames the folder to ``<name>`` (which fails rather than replace a non-empty folder) and
fsyncs the root so the rename itself survives a power cut. ``staging_name`` only makes up the
staging folder's name (``save()`` calls it on the training thread, so it does no I/O);
``prepare_staging`` makes the folder, in the training process but off the training thread
(the pool's dispatcher, before the first job of a checkpoint is sent; the committer), and
``commit`` alone refuses a name that is already taken. Uploaders never create a staging
folder: one that outlives its trainer cannot bring back a folder that ``abort`` or the next
open's recovery removed; its write fails instead.

The single-writer lock is an ``flock`` on ``<root>/.mpckpt.lock``: the kernel drops it when
its process dies, so a crashed trainer never blocks the next one.

The walk below the root (every component opened ``O_NOFOLLOW``: nothing below the root is
reached through a symbolic link) lives in ``_localwalk.py``, which ``LocalBackend`` inherits;
the descriptor-level helpers behind it in ``_localfs.py``.

Storage options: ``direct_io`` (bool, default true) writes block-aligned spans with
``O_DIRECT`` where the filesystem has it. Other options are ignored.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import shutil
import stat
from collections.abc import Mapping, Sequence
from typing import Any

from mpckpt.errors import (
    CheckpointNotFoundError,
    CommitConflictError,
    ConfigError,
    CorruptCheckpointError,
    LockedError,
    StorageError,
)
from mpckpt.storage._localfs import (
    DIR_FLAGS,
    NO_LINKS,
    ROOT_FLAGS,
    FlockLock,
    create_file,
    kind,
    lstat,
    pread_into,
    pwrite_all,
    read_all,
    refused,
    remove_tree,
    storage_error,
)
from mpckpt.storage._localwalk import STAGING_PREFIX, RootWalk
from mpckpt.storage.base import MANIFEST_NAME, BackendSpec, Buffer, check_relpath

LOCK_NAME = ".mpckpt.lock"
_BLOCK = 4096
_DIRECT_MIN = 1 << 20  # below this, buffered writes are as cheap
_LOCK_KIND = "its lock file (a regular file)"


class LocalBackend(RootWalk):
    """Checkpoints in a folder of the local filesystem."""

    def __init__(self, root: str, options: Mapping[str, Any] | None = None) -> None:
        self.root = os.path.abspath(root)
        self.url = self.root
        self._options = dict(options or {})
        direct_io = self._options.get("direct_io", True)
        if not isinstance(direct_io, bool):
            raise ConfigError(f"storage option direct_io={direct_io!r} for {self.root} must be true or false")
        self.direct_io = direct_io and hasattr(os, "O_DIRECT")  # turned off if the filesystem refuses it

    def spec(self) -> BackendSpec:
        return BackendSpec("file", self.root, dict(self._options))

    # -- set-up --------------------------------------------------------------------------
    def check_writable(self) -> None:
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"checkpoint root {self.root} cannot be created: {e.strerror}; "
                              "choose a folder you can write to") from e
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise ConfigError(f"checkpoint root {self.root} is not writable; choose a folder you can write to")

    def acquire_writer_lock(self, owner: str) -> FlockLock:
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
                raise refused(path, st.st_mode, expected=_LOCK_KIND, writing=True)
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
                raise storage_error(e, f"cannot take the lock {path}") from e
            raise
        return FlockLock(fd)

    # -- writing ------------------------------------------------------------------------
    def staging_name(self, name: str, *, run: str | None = None) -> str:
        # No I/O: save() calls this on the training thread. A fresh name on every call, so two
        # attempts (or two writers) never share a staging folder; commit refuses a taken name.
        # The ranks of one job share one: ``run``, a token of this open of the root.
        if run is not None:
            if not run.isalnum():
                raise ConfigError(f"staging run token {run!r} must be letters and digits")
            return f"{STAGING_PREFIX}{_top_level(name)}.run-{run}"
        return f"{STAGING_PREFIX}{_top_level(name)}.{os.getpid()}.{secrets.token_hex(4)}"

    def prepare_staging(self, staging: str) -> None:
        staging = _top_level(staging)
        if not staging.startswith(STAGING_PREFIX):
            raise ConfigError(f"{staging!r} is not a staging folder of {self.root}")
        with self._parent(f"{staging}/{MANIFEST_NAME}", create=True, create_staging=True):
            pass  # made (or found) and opened without following a link

    def write_file(self, relpath: str, parts: Sequence[Buffer]) -> None:
        path = self._abs(relpath)
        with self._parent(relpath, create=True) as (parent, name):
            try:
                fd = create_file(parent, name, path)
            except OSError as e:
                raise storage_error(e, f"cannot create {path}") from e
            try:
                offset = 0
                for part in parts:
                    view = memoryview(part).cast("B")
                    done = self._write_direct(parent, name, fd, view, offset) if self.direct_io else 0
                    pwrite_all(fd, view[done:], offset + done)
                    offset += len(view)
                os.fsync(fd)
                if not relpath.startswith(STAGING_PREFIX):
                    os.fsync(parent)  # a shared file: no commit renames (and syncs) a folder holding it
            except OSError as e:
                raise storage_error(e, f"cannot write {path}") from e
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
            return pwrite_all(direct, view[:span], offset)
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
            raise storage_error(e, f"cannot read {local_path}") from e
        with src, self._parent(relpath, create=True) as (parent, name):
            try:
                with os.fdopen(create_file(parent, name, path), "wb") as dst:
                    shutil.copyfileobj(src, dst, 16 << 20)
                    dst.flush()
                    os.fsync(dst.fileno())
            except OSError as e:
                raise storage_error(e, f"cannot copy {local_path} to {path}") from e

    def adopt_folder(self, local_path: str, relpath: str) -> None:
        source, path = os.path.abspath(local_path), self._abs(relpath)
        try:  # the folders above the user's folder are the user's to link; the folder itself is not
            src_parent = os.open(os.path.dirname(source), ROOT_FLAGS)
        except OSError as e:
            raise CheckpointNotFoundError(f"cannot move {source}: {e.strerror}") from e
        base = os.path.basename(source)
        try:
            before = lstat(base, src_parent)
            if before is None:
                raise CheckpointNotFoundError(f"cannot move {source}: it does not exist")
            if not stat.S_ISDIR(before.st_mode):
                raise ConfigError(f"{source} is {kind(before.st_mode)}, not a folder; mode=NO_UPLOAD moves a "
                                  "folder itself, never through a link: give the folder's own path")
            with self._parent(relpath, create=True, create_staging=True) as (parent, name):
                try:
                    os.rename(base, name, src_dir_fd=src_parent, dst_dir_fd=parent)  # replaces no link or file
                except OSError as e:
                    raise self._adopt_error(e, parent, name, source, path) from e
                after = lstat(name, parent)
                if after is None or not os.path.samestat(before, after):
                    with contextlib.suppress(OSError):  # swapped for something else meanwhile: give it back
                        os.rename(name, base, src_dir_fd=parent, dst_dir_fd=src_parent)
                    raise StorageError(f"{source} was replaced while it was moved to {path}; nothing was adopted")
        finally:
            os.close(src_parent)

    def _adopt_error(self, e: OSError, parent: int, name: str, source: str, path: str) -> Exception:
        """The error for failing to rename the user's folder ``source`` to ``name`` (at ``path``)."""
        if e.errno == errno.EXDEV:
            return ConfigError(f"mode=NO_UPLOAD: cannot move {source} to {path} ({e.strerror}); it must be on "
                               f"the same filesystem as {self.root}, or use ASYNC")
        st = lstat(name, parent)
        if st is not None and e.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
            return refused(path, st.st_mode, expected="nothing (a folder is moved there)", writing=True)
        return storage_error(e, f"cannot move {source} to {path}")

    def commit(self, staging: str, name: str, manifest: bytes) -> None:
        staging, name = _top_level(staging), _top_level(name)
        self.prepare_staging(staging)  # a checkpoint may have no data file of its own
        # INVARIANT: the manifest is written last, after every data file was fsynced.
        self.write_file(f"{staging}/{MANIFEST_NAME}", [manifest])
        root = self._open_root()
        try:
            for _dirpath, _dirs, _files, folder in os.fwalk(staging, dir_fd=root):  # never follows links
                os.fsync(folder)
            self._refuse_committed(root, name)
            if lstat(name, root) is not None:  # a manifest-less leftover was never a checkpoint
                remove_tree(root, name)
            os.rename(staging, name, src_dir_fd=root, dst_dir_fd=root)  # replaces no link, file or full folder
            os.fsync(root)
        except OSError as e:
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                raise CommitConflictError(f"checkpoint {name} appeared in {self.root} while committing") from e
            raise storage_error(e, f"cannot commit {name} in {self.root}") from e
        finally:
            os.close(root)

    def _refuse_committed(self, root: int, name: str) -> None:
        """``CommitConflictError`` if ``name`` is committed, or is anything but a folder of ours."""
        path = os.path.join(self.root, name)
        st = lstat(name, root)
        if st is None:
            return
        if not stat.S_ISDIR(st.st_mode):
            raise CommitConflictError(f"{path} is {kind(st.st_mode)}, not a checkpoint folder; {NO_LINKS} "
                                      "and never replaces what it did not write: remove it to save this step")
        folder = os.open(name, DIR_FLAGS, dir_fd=root)
        try:
            if lstat(MANIFEST_NAME, folder) is not None:
                raise CommitConflictError(f"checkpoint {name} already exists in {self.root}; it is never overwritten")
        finally:
            os.close(folder)

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
            raise storage_error(e, f"cannot list {self.root}") from e

    def list_files(self, folder: str) -> list[str]:
        folder = check_relpath(folder)
        try:
            with self._parent(f"{folder}/{MANIFEST_NAME}") as (fd, _name):  # the folder, opened without links
                with os.scandir(fd) as entries:
                    names = [e.name for e in entries if e.is_file(follow_symlinks=False)]
        except CheckpointNotFoundError:
            return []
        except OSError as e:
            raise storage_error(e, f"cannot list {self._abs(folder)}") from e
        return sorted(f"{folder}/{name}" for name in names)

    def read_bytes(self, relpath: str, *, max_bytes: int | None = None) -> bytes:
        path = self._abs(relpath)
        fd, st = self._open_file(relpath)
        try:
            if max_bytes is not None and st.st_size > max_bytes:
                raise CorruptCheckpointError(
                    f"{path} is {st.st_size} bytes, more than the {max_bytes} such a file may have; "
                    "it is damaged or not written by mpckpt", path=path)
            return read_all(fd, st.st_size, max_bytes, path)
        except OSError as e:
            raise storage_error(e, f"cannot read {path}") from e
        finally:
            os.close(fd)

    def read_into(self, relpath: str, offset: int, out: memoryview) -> None:
        path = self._abs(relpath)
        fd, _st = self._open_file(relpath)
        try:
            view = out.cast("B")
            got = pread_into(fd, view, offset)
            if got < len(view):
                raise CorruptCheckpointError(
                    f"{path} is truncated: wanted bytes up to {offset + len(view)}, file ends at {offset + got}",
                    path=path,
                )
        except OSError as e:
            raise storage_error(e, f"cannot read {path}") from e
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
            raise storage_error(e, f"cannot delete {self._abs(name)}") from e

    def set_aside(self, name: str, aside: str) -> None:
        name, aside = _top_level(name), _top_level(aside)
        root = self._open_root()
        try:
            os.rename(name, aside, src_dir_fd=root, dst_dir_fd=root)  # one rename: atomic, a link moved as is
            os.fsync(root)
        except OSError as e:
            raise storage_error(e, f"cannot move {self._abs(name)} to {self._abs(aside)}") from e
        finally:
            os.close(root)

    def delete_file(self, relpath: str) -> None:
        try:
            with self._parent(relpath) as (parent, name):
                st = lstat(name, parent)
                if st is not None and not stat.S_ISDIR(st.st_mode):  # a file, or a link itself
                    os.unlink(name, dir_fd=parent)
        except CheckpointNotFoundError:
            return
        except FileNotFoundError:
            return
        except OSError as e:
            raise storage_error(e, f"cannot delete {self._abs(relpath)}") from e

    @staticmethod
    def _remove(parent: int, name: str) -> None:
        """Remove folder ``name``, manifest first; a link only unlinked; anything else left alone."""
        st = lstat(name, parent)
        if st is None:
            return
        if stat.S_ISLNK(st.st_mode):
            os.unlink(name, dir_fd=parent)  # the link itself, never what it points to
            return
        if not stat.S_ISDIR(st.st_mode):
            return  # not a folder mpckpt wrote: not ours to delete
        try:
            folder = os.open(name, DIR_FLAGS, dir_fd=parent)
        except OSError:
            return  # replaced since the lstat: not ours to delete either
        try:
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                os.unlink(MANIFEST_NAME, dir_fd=folder)  # stop existing first
        finally:
            os.close(folder)
        with contextlib.suppress(OSError):  # the manifest is gone: leftovers are no checkpoint
            remove_tree(parent, name)

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
