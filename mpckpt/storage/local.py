"""Local-disk backend: direct writes from shared memory, fsync, atomic folder rename.

Commit protocol (POSIX): files are written into ``.tmp.<name>.<pid>.<token>/`` beside the
destination and fsynced; ``commit`` writes ``manifest.json`` there, fsyncs it and the folder,
renames the folder to ``<name>`` (which fails rather than replace a non-empty folder) and
fsyncs the root so the rename itself survives a power cut.

The single-writer lock is an ``flock`` on ``<root>/.mpckpt.lock``: the kernel drops it when
its process dies, so a crashed trainer never blocks the next one.
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import shutil
from collections.abc import Sequence

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


def _storage_error(e: OSError, what: str) -> StorageError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return StorageFullError(f"{what}: {e.strerror} (errno {e.errno}); free space and save again")
    return StorageError(f"{what}: {e.strerror or e}")


def _pwrite_all(fd: int, view: memoryview, offset: int) -> int:
    pos = 0
    while pos < len(view):
        pos += os.pwrite(fd, view[pos:pos + _WRITE_CHUNK], offset + pos)
    return pos


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = ""
            try:
                holder = os.pread(fd, 256, 0).decode(errors="replace").strip()
            except OSError:
                pass
            os.close(fd)
            raise LockedError(
                f"{self.root} is being written by another live process ({holder or 'unknown'}); "
                "use a different folder or stop the other writer"
            ) from e
        os.ftruncate(fd, 0)
        os.pwrite(fd, owner.encode(), 0)
        return _FlockLock(fd)

    def _make_parents(self, relpath: str) -> None:
        """Create the folders a file needs, but never bring back a removed staging folder.

        INVARIANT: a staging folder removed by cleanup stays removed: a straggling writer (an
        uploader of a crashed trainer) gets an error instead of bringing the folder back.
        """
        top = check_relpath(relpath).split("/", 1)[0]
        if top.startswith(STAGING_PREFIX) and not os.path.isdir(os.path.join(self.root, top)):
            raise StorageError(f"{os.path.join(self.root, top)} no longer exists (the checkpoint was aborted or cleaned up)")
        os.makedirs(os.path.dirname(self._abs(relpath)), exist_ok=True)

    # -- writing ------------------------------------------------------------------------
    def stage(self, name: str) -> str:
        check_relpath(name)
        if os.path.exists(os.path.join(self.root, name, MANIFEST_NAME)):
            raise CommitConflictError(f"checkpoint {name} already exists in {self.root}; it is never overwritten")
        staging = f"{STAGING_PREFIX}{name}.{os.getpid()}.{secrets.token_hex(4)}"
        try:
            os.makedirs(os.path.join(self.root, staging))
        except OSError as e:
            raise _storage_error(e, f"cannot create staging folder in {self.root}") from e
        return staging

    def write_file(self, relpath: str, parts: Sequence[Buffer]) -> None:
        path = self._abs(relpath)
        try:
            self._make_parents(relpath)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError as e:
            raise _storage_error(e, f"cannot create {path}") from e
        try:
            offset = 0
            for part in parts:
                view = memoryview(part).cast("B")
                done = self._write_direct(path, view, offset) if self.direct_io else 0
                _pwrite_all(fd, view[done:], offset + done)
                offset += len(view)
            os.fsync(fd)
        except OSError as e:
            raise _storage_error(e, f"cannot write {path}") from e
        finally:
            os.close(fd)

    def _write_direct(self, path: str, view: memoryview, offset: int) -> int:
        """Write the block-aligned head of ``view`` with O_DIRECT; return the bytes written.

        Direct I/O sends shared memory to the device without copying it into the page cache,
        so persisting costs training neither a kernel memcpy nor dirty-page writeback. Only
        block-aligned spans qualify (the layout aligns shard data to 4096 in memory and in the
        file); anything else, and filesystems without O_DIRECT (tmpfs), go the buffered way.
        """
        span = len(view) // _BLOCK * _BLOCK
        if span < _DIRECT_MIN or offset % _BLOCK:
            return 0
        try:
            fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
        except (OSError, AttributeError):
            self.direct_io = False  # this filesystem refuses it; stop trying
            return 0
        try:
            return _pwrite_all(fd, view[:span], offset)
        except OSError as e:
            if e.errno != errno.EINVAL:  # EINVAL: memory not aligned; the rest goes buffered
                raise
            return 0
        finally:
            os.close(fd)

    def upload_file(self, relpath: str, local_path: str) -> None:
        path = self._abs(relpath)
        try:
            self._make_parents(relpath)
            with open(local_path, "rb") as src, open(path, "wb") as dst:
                shutil.copyfileobj(src, dst, 16 << 20)
                dst.flush()
                os.fsync(dst.fileno())
        except FileNotFoundError as e:
            raise CheckpointNotFoundError(f"cannot upload {local_path}: it does not exist") from e
        except OSError as e:
            raise _storage_error(e, f"cannot copy {local_path} to {path}") from e

    def commit(self, staging: str, name: str, manifest: bytes) -> None:
        staging_path = self._abs(staging)
        final = self._abs(name)
        try:
            # INVARIANT: the manifest is written last, after every data file was fsynced.
            self.write_file(f"{staging}/{MANIFEST_NAME}", [manifest])
            for dirpath, _dirs, _files in os.walk(staging_path):
                fsync_dir(dirpath)
            if os.path.exists(os.path.join(final, MANIFEST_NAME)):
                raise CommitConflictError(f"checkpoint {name} already exists in {self.root}; not replaced")
            if os.path.isdir(final):  # a manifest-less leftover was never a checkpoint
                shutil.rmtree(final)
            os.rename(staging_path, final)
            fsync_dir(self.root)
        except CommitConflictError:
            raise
        except OSError as e:
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise CommitConflictError(f"checkpoint {name} appeared in {self.root} while committing") from e
            raise _storage_error(e, f"cannot commit {name} in {self.root}") from e

    def abort(self, staging: str) -> None:
        path = self._abs(staging)
        if os.path.basename(path).startswith(STAGING_PREFIX):
            shutil.rmtree(path, ignore_errors=True)

    # -- reading ------------------------------------------------------------------------
    def list_names(self) -> list[str]:
        try:
            return sorted(e.name for e in os.scandir(self.root) if e.is_dir())
        except FileNotFoundError:
            return []

    def read_bytes(self, relpath: str) -> bytes:
        path = self._abs(relpath)
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError as e:
            raise CheckpointNotFoundError(f"{path} does not exist") from e
        except OSError as e:
            raise StorageError(f"cannot read {path}: {e.strerror}") from e

    def read_into(self, relpath: str, offset: int, out: memoryview) -> None:
        path = self._abs(relpath)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError as e:
            raise CheckpointNotFoundError(f"{path} does not exist") from e
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
        finally:
            os.close(fd)

    def size(self, relpath: str) -> int:
        path = self._abs(relpath)
        try:
            return os.stat(path).st_size
        except FileNotFoundError as e:
            raise CheckpointNotFoundError(f"{path} does not exist") from e

    def exists(self, relpath: str) -> bool:
        return os.path.exists(self._abs(relpath))

    # -- housekeeping -------------------------------------------------------------------
    def delete(self, name: str) -> None:
        path = self._abs(name)
        try:
            os.unlink(os.path.join(path, MANIFEST_NAME))  # stop existing first
        except FileNotFoundError:
            pass
        shutil.rmtree(path, ignore_errors=True)

    def cleanup_incomplete(self) -> list[str]:
        removed = []
        for name in self.list_names():
            if name.startswith(STAGING_PREFIX):
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
                removed.append(name)
        return removed
