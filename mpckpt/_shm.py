"""Named POSIX shared-memory segments: create (0600, unguessable name), attach, unlink, reap.

This module imports no torch, so uploader processes stay small. The training process
creates segments; uploaders only attach read-only by name. Names are
``mpckpt-<creator pid>-<32 hex chars>`` so that a later process can recognise segments left
behind by a creator that died (``reap_orphans``) and nothing else.

We bypass ``multiprocessing.shared_memory`` on purpose: its resource tracker would unlink a
segment when any attaching process exits, which is exactly wrong for a pool of uploaders.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets

import psutil

try:
    import _posixshmem
except ImportError:  # pragma: no cover - non-POSIX
    _posixshmem = None

PREFIX = "mpckpt-"
SHM_DIR = "/dev/shm"
_NAME_RE = re.compile(r"^mpckpt-(\d+)-[0-9a-f]{32}$")


def _shm_open(name: str, flags: int, mode: int = 0o600) -> int:
    if _posixshmem is not None:
        return _posixshmem.shm_open("/" + name, flags, mode=mode)
    return os.open(os.path.join(SHM_DIR, name), flags, mode)  # pragma: no cover


def _shm_unlink(name: str) -> None:
    if _posixshmem is not None:
        _posixshmem.shm_unlink("/" + name)
    else:  # pragma: no cover
        os.unlink(os.path.join(SHM_DIR, name))


class Segment:
    """One mapped shared-memory segment."""

    def __init__(self, name: str, size: int, mm: mmap.mmap, *, owner: bool) -> None:
        self.name = name
        self.size = size
        self.mmap = mm
        self.owner = owner

    @classmethod
    def create(cls, size: int) -> Segment:
        if size <= 0:
            raise ValueError(f"shared-memory segment size must be positive, got {size}")
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(16)}"
        fd = _shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            _shm_unlink(name)
            raise
        os.close(fd)
        return cls(name, size, mm, owner=True)

    @classmethod
    def attach(cls, name: str, size: int) -> Segment:
        if not _NAME_RE.match(name):
            raise ValueError(f"{name!r} is not an mpckpt shared-memory segment name")
        fd = _shm_open(name, os.O_RDONLY)
        try:
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        return cls(name, size, mm, owner=False)

    def close(self) -> None:
        try:
            self.mmap.close()
        except BufferError:
            # A tensor or memoryview still points into it; the mapping goes when they do.
            pass

    def unlink(self) -> None:
        try:
            _shm_unlink(self.name)
        except FileNotFoundError:
            pass


def list_segments() -> list[str]:
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if _NAME_RE.match(n))
    except OSError:
        return []


def _creator_alive(pid: int, path: str) -> bool:
    try:
        proc = psutil.Process(pid)
        created = os.stat(path).st_ctime
        # A pid reused by a process that started after the segment is not its creator.
        return proc.create_time() <= created + 1.0 and proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, FileNotFoundError):
        return False
    except psutil.Error:
        return True


def reap_orphans() -> list[str]:
    """Unlink mpckpt segments whose creating process is gone; return their names."""
    removed = []
    for name in list_segments():
        m = _NAME_RE.match(name)
        assert m is not None
        if not _creator_alive(int(m.group(1)), os.path.join(SHM_DIR, name)):
            try:
                _shm_unlink(name)
                removed.append(name)
            except (FileNotFoundError, PermissionError):
                pass
    return removed
