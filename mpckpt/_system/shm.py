"""Named POSIX shared-memory segments: create (0600, unguessable name), attach, unlink, reap.

This module imports no torch, so uploader processes stay small. The training process
creates segments; uploaders only attach read-only by name. Names in /dev/shm::

    mpckpt-<pid>-<owner token>.owner       the owner file of one creating process
    mpckpt-<pid>-<owner token>-<32 hex>    a segment of that owner (its prefix + 128 random bits)

Liveness never depends on pid numbers: a pid means nothing in another PID namespace that
shares /dev/shm (a sidecar container, ``--ipc=host``), and pids are reused. The pid is in the
names for humans only.

The owner protocol (INVARIANTS):

* A process holds an exclusive ``flock`` on its owner file for as long as any segment named
  with its prefix exists: the file is created (O_EXCL, O_NOFOLLOW, 0600), locked and then
  filled with a line about its owner *before* the first segment, and unlinked only after the
  last segment was unlinked (when its last Checkpointer closes; at exit if none is left).
  When the process dies the kernel drops the flock, whatever PID namespace the owner and
  the reaper are in: the lock lives on the tmpfs file, not on a pid.
* A fork child does not inherit ownership: a fork hook closes its copy of the locked file
  description (a flock is shared by every descriptor of one open file description).
* The reaper judges an owner dead only if it can take the lock itself (LOCK_EX|LOCK_NB) and
  the file is not empty. An empty unlocked file is an owner between ``open`` and ``flock``,
  so it is left alone unless older than ``UNBORN_GRACE_S``; its creator re-checks that the name
  is still its file after locking, so even a wrong guess costs it only a retry.
* The reaper unlinks a dead owner's segments, then its owner file, while holding the lock,
  and only regular files (never links, directories, or anything of another user) whose
  names match exactly. Nothing in /dev/shm is ever opened following a symlink.

Segments without an owner file are judged by use, never by pid:

* ``mpckpt-<pid>-<32 hex>``, made by mpckpt before owner files, may belong to a live trainer
  of that version in any PID namespace. It is removed only if no process has it mapped or
  open, which only a process that sees every process can tell (root in the initial PID
  namespace, allowed to read every /proc/<pid>/fd and maps); anyone else leaves it alone
  (``mpckpt gc`` says so).
* One of this version whose owner file is gone has no owner (see the first invariant; the
  owner file was removed by hand, or the name changed): it is removed, unless a process is
  seen to use it.

Uploaders attach only to names of this version's segment form, and only to a regular file
at least as long as the job says (a shorter one would kill them with SIGBUS).
``segments_of_this_process`` says which segments are this process's (tests use it).

We bypass ``multiprocessing.shared_memory`` on purpose: its resource tracker would unlink a
segment when any attaching process exits, which is exactly wrong for a pool of uploaders.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import logging
import mmap
import os
import re
import secrets
import stat
import threading
import time
from collections.abc import Callable

try:
    import _posixshmem
except ImportError:  # pragma: no cover - non-POSIX
    _posixshmem = None

log = logging.getLogger("mpckpt")

PREFIX = "mpckpt-"
SHM_DIR = "/dev/shm"
OWNER_SUFFIX = ".owner"
UNBORN_GRACE_S = 60.0  # an empty, unlocked owner file younger than this is being created
# names are matched whole (fullmatch: "$" would also accept a trailing newline)
_SEGMENT_RE = re.compile(r"(mpckpt-[0-9]{1,10}-[0-9a-f]{32})-[0-9a-f]{32}")
_OWNER_RE = re.compile(r"(mpckpt-[0-9]{1,10}-[0-9a-f]{32})\.owner")
_OLD_RE = re.compile(r"mpckpt-[0-9]{1,10}-[0-9a-f]{32}")  # before owner files: no owner at all
_PROC_PID_INIT_INO = 0xEFFFFFFC  # the inode of the initial PID namespace (include/linux/proc_ns.h)


def _shm_open(name: str, flags: int, mode: int = 0o600) -> int:
    # glibc's shm_open adds O_NOFOLLOW | O_CLOEXEC; the fallback does the same
    if _posixshmem is not None:
        return _posixshmem.shm_open("/" + name, flags, mode=mode)
    return os.open(os.path.join(SHM_DIR, name), flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)  # pragma: no cover


def _shm_unlink(name: str) -> None:
    if _posixshmem is not None:
        _posixshmem.shm_unlink("/" + name)
    else:  # pragma: no cover
        os.unlink(os.path.join(SHM_DIR, name))


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


# -- ownership: this process's owner file --------------------------------------------------------

class _Owner:
    """This process's locked owner file and how many of its segments exist."""

    def __init__(self, prefix: str, fd: int) -> None:
        self.prefix = prefix
        self.fd = fd
        self.segments = 0


_guard = threading.Lock()
_owner: _Owner | None = None
_hooks_installed = False


def _same_file(fd: int, name: str) -> bool:
    """Whether ``name`` in /dev/shm is still the file open as ``fd`` (not removed or replaced)."""
    try:
        here, there = os.fstat(fd), os.lstat(_path(name))
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _new_owner() -> _Owner:
    """Create, lock and fill a fresh owner file; a reaper never sees it filled and unlocked."""
    for _ in range(5):
        prefix = f"{PREFIX}{os.getpid()}-{secrets.token_hex(16)}"
        name = prefix + OWNER_SUFFIX
        fd = os.open(_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = _same_file(fd, name)  # a reaper may have judged it unborn for too long
            except BlockingIOError:
                locked = False  # a reaper is looking at it right now: leave it, take another token
            if locked:
                # INVARIANT: filled only after the lock is held; a filled unlocked file means a dead owner
                os.write(fd, (f"mpckpt owner file: whoever holds its flock owns /dev/shm/{prefix}-*\n"
                              f"pid {os.getpid()} pidns {_pid_namespace()} at {time.time():.0f}\n").encode())
                return _Owner(prefix, fd)
            if _same_file(fd, name):
                os.unlink(_path(name))
        except BaseException:
            if _same_file(fd, name):
                os.unlink(_path(name))
            os.close(fd)
            raise
        os.close(fd)
    raise OSError(errno.EAGAIN, f"could not create an owner file in {SHM_DIR}: it was taken away 5 times")


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _open_new_segment(link_from: str | None = None) -> tuple[_Owner, str, int]:
    """A new segment's owner (made on first use), name and descriptor: counted, created 0600
    (``link_from``: a new name of that existing file, opened read-write). Both under ``_guard``,
    so no one ever finds the count above the segments that exist or are being unlinked.
    """
    global _owner, _hooks_installed
    with _guard:
        if not _hooks_installed:
            os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                                after_in_child=_after_fork_in_child)
            atexit.register(_at_exit)
            _hooks_installed = True
        if _owner is None:
            _owner = _new_owner()
        # INVARIANT: the owner file exists and is locked before the segment
        name = f"{_owner.prefix}-{secrets.token_hex(16)}"
        try:
            if link_from is None:
                fd = _shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            else:
                os.link(link_from, _path(name), follow_symlinks=False)
                try:
                    fd = _shm_open(name, os.O_RDWR)
                except BaseException:
                    _shm_unlink(name)
                    raise
        except BaseException:
            if _owner.segments == 0:
                _let_go(_owner)
            raise
        _owner.segments += 1
        return _owner, name, fd


def _drop_owner(owner: _Owner) -> None:
    """One segment of ``owner`` is gone; with the last, remove the owner file and let go of it."""
    with _guard:
        if owner is not _owner:
            return  # an owner of the parent seen in a fork child, or let go of at exit
        owner.segments -= 1
        if owner.segments <= 0:
            _let_go(owner)


def _let_go(owner: _Owner) -> None:
    """Unlink the owner file while still locked, then unlock it; called under ``_guard``."""
    global _owner
    _owner = None
    name = owner.prefix + OWNER_SUFFIX
    try:
        if _same_file(owner.fd, name):
            os.unlink(_path(name))  # INVARIANT: after the last segment, before the lock goes
    finally:
        os.close(owner.fd)


def _before_fork() -> None:
    _guard.acquire()  # no owner is half made or half released while the process is copied


def _after_fork_in_parent() -> None:
    _guard.release()


def _after_fork_in_child() -> None:
    """The child shares the parent's locked file description: close its copy, own nothing."""
    global _guard, _owner
    _guard = threading.Lock()
    if _owner is not None:
        try:
            os.close(_owner.fd)
        except OSError:
            pass
    _owner = None


def _at_exit() -> None:
    """Let go of the owner file if none of its segments is left (else the kernel drops the
    lock at exit and a reaper removes both).

    Segments still there are left for a reaper, never unlinked here: Checkpointers whose
    atexit hooks run after this one still upload from them, then unlink them.
    """
    with _guard:
        if _owner is not None and not any(n.startswith(_owner.prefix + "-") for n in list_segments()):
            _let_go(_owner)  # a segment made after this gets a new owner file


def segments_of_this_process() -> list[str]:
    """Names of the segments this process created that still exist (none after a fork)."""
    with _guard:
        prefix = None if _owner is None else _owner.prefix + "-"
    if prefix is None:
        return []
    return [n for n in list_segments() if n.startswith(prefix)]


# -- segments ----------------------------------------------------------------------------------------

class Segment:
    """One mapped shared-memory segment."""

    def __init__(self, name: str, size: int, mm: mmap.mmap, *, owner: bool, by: _Owner | None = None) -> None:
        self.name = name
        self.size = size
        self.mmap = mm
        self.owner = owner
        self._by = by  # the owner counting this segment until it is unlinked

    @classmethod
    def create(cls, size: int, *, allocate: bool = True) -> Segment:
        if size <= 0:
            raise ValueError(f"shared-memory segment size must be positive, got {size}")
        def allocate_pages(fd: int) -> None:
            os.ftruncate(fd, size)
            if allocate:  # INVARIANT: every page allocated now (else before a write through the map: _stage.written):
                os.posix_fallocate(fd, 0, size)  # a full /dev/shm is ENOSPC here, never a SIGBUS at a write into a hole

        return cls._mapped(*_open_new_segment(), size, allocate_pages)

    @classmethod
    def adopt(cls, path: str, size: int) -> Segment:
        """A segment of this process for the file ``path`` (a snapshot a process that is gone kept
        in memory; this user's, mode 0600, ``size`` bytes or more): a new name, owned as a created one."""
        def check(fd: int) -> None:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) != 0o600 \
                    or st.st_size < size:
                raise OSError(errno.EPERM, f"{path} is not a regular file of this user, mode 600, of {size} bytes")

        return cls._mapped(*_open_new_segment(link_from=path), size, check)

    @classmethod
    def _mapped(cls, by: _Owner, name: str, fd: int, size: int, prepare: Callable[[int], None]) -> Segment:
        """``name`` (open as ``fd``) mapped read-write once ``prepare(fd)`` passed; else unlinked, uncounted."""
        try:
            prepare(fd)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            _shm_unlink(name)
            _drop_owner(by)
            raise
        os.close(fd)
        return cls(name, size, mm, owner=True, by=by)

    @classmethod
    def attach(cls, name: str, size: int) -> Segment:
        if not _SEGMENT_RE.fullmatch(name):
            raise ValueError(f"{name!r} is not an mpckpt shared-memory segment name")
        fd = _shm_open(name, os.O_RDONLY)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size < size:
                # mapping past the end would kill this process with SIGBUS at the first read
                raise OSError(errno.EINVAL, f"shared-memory segment {name} is not a regular file of "
                              f"at least {size} bytes (it has {st.st_size})")
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
        finally:
            by, self._by = self._by, None
            if by is not None:
                _drop_owner(by)


def list_segments() -> list[str]:
    """Names in /dev/shm of the form of a segment (this version's or an earlier one's)."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if _SEGMENT_RE.fullmatch(n) or _OLD_RE.fullmatch(n))
    except OSError:
        return []


# -- the reaper --------------------------------------------------------------------------------------

def reap_orphans(*, undecided: list[str] | None = None) -> list[str]:
    """Unlink the segments of dead owners (and their owner files); return the segment names.

    Segments without an owner file that this process cannot judge are left alone and, if
    ``undecided`` is given, appended to it.
    """
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    owners = {m.group(1) for m in map(_OWNER_RE.fullmatch, names) if m}
    removed: list[str] = []
    for prefix in sorted(owners):
        removed += _reap_owner(prefix)
    ownerless = sorted(n for n in names if _OLD_RE.fullmatch(n) or
                       ((m := _SEGMENT_RE.fullmatch(n)) is not None and m.group(1) not in owners))
    if ownerless:
        removed += _reap_ownerless(ownerless, undecided)
    return removed


def _reap_owner(prefix: str) -> list[str]:
    """If the owner ``prefix`` is dead, unlink its segments and owner file, holding its lock."""
    name = prefix + OWNER_SUFFIX
    try:
        fd = os.open(_path(name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return []  # gone, a symlink (ELOOP), or another user's (EACCES): not ours to judge
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return []  # held: the owner lives (EWOULDBLOCK), or cannot be locked at all
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or not _same_file(fd, name):
            return []
        if st.st_size == 0 and time.time() - st.st_mtime < UNBORN_GRACE_S:
            return []  # its creator has not locked it yet
        removed = _unlink_matching(prefix + "-", st.st_uid)
        if _unlink_if(name, st.st_uid, same_as=st):  # INVARIANT: the owner file goes last
            log.debug("removed the owner file %s of a dead process", name)
        return removed
    finally:
        os.close(fd)


def _unlink_matching(prefix: str, uid: int) -> list[str]:
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    return [n for n in sorted(names) if n.startswith(prefix) and _SEGMENT_RE.fullmatch(n) and _unlink_if(n, uid)]


def _unlink_if(name: str, uid: int, *, same_as: os.stat_result | None = None) -> bool:
    """Unlink ``name`` if it is a regular file of ``uid`` (and the file ``same_as``, if given)."""
    try:
        st = os.lstat(_path(name))
        if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
            return False
        if same_as is not None and (st.st_dev, st.st_ino) != (same_as.st_dev, same_as.st_ino):
            return False
        os.unlink(_path(name))
    except OSError:  # gone already, or not ours to unlink (sticky /dev/shm)
        return False
    return True


def _reap_ownerless(candidates: list[str], undecided: list[str] | None) -> list[str]:
    """Unlink segments without an owner file that no process is known to use.

    One of this version whose owner file is gone has no owner (the owner file is made before
    and removed after every segment of its owner), so it goes unless we see a process using
    it. One of an earlier version never had an owner file: it goes only if we can see every
    process and none uses it.
    """
    files = {}
    for name in candidates:
        m = _SEGMENT_RE.fullmatch(name)
        if m is not None and os.path.lexists(_path(m.group(1) + OWNER_SUFFIX)):
            continue  # its owner file appeared after our listing: judged by the lock next time
        try:
            st = os.lstat(_path(name))
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            files[name] = st
    if not files:
        return []
    in_use = _files_in_use()
    removed = []
    for name, st in files.items():
        if in_use is not None and (st.st_dev, st.st_ino) in in_use:
            continue  # mapped or open somewhere: whoever made it still uses it
        if in_use is None and _OLD_RE.fullmatch(name):
            if undecided is not None:
                undecided.append(name)
            continue
        if _unlink_if(name, st.st_uid, same_as=st):
            removed.append(name)
    return removed


def _sees_every_process() -> bool:
    """Whether /proc shows every process of this machine: we are in the initial PID namespace."""
    try:
        return (os.stat("/proc/self/ns/pid").st_ino == _PROC_PID_INIT_INO
                and os.readlink("/proc/self") == str(os.getpid()))
    except OSError:
        return False


def _files_in_use() -> set[tuple[int, int]] | None:
    """(device, inode) of every file any process has open or mapped; None if we cannot tell."""
    if not _sees_every_process():
        return None
    used: set[tuple[int, int]] = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            theirs = files_used_by(int(entry))
            if theirs is None:
                return None
            used |= theirs
    return used


def files_used_by(pid: int) -> set[tuple[int, int]] | None:
    """(device, inode) of the files process ``pid`` has open or mapped (empty if it is gone);
    None if we may not look."""
    used: set[tuple[int, int]] = set()
    try:
        # INVARIANT: descriptors before mappings; a creator closes its descriptor only after mapping
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                st = os.stat(f"/proc/{pid}/fd/{fd}")
            except FileNotFoundError:
                continue
            used.add((st.st_dev, st.st_ino))
        with open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) >= 5 and fields[4] != "0":
                    major, minor = fields[3].split(":")
                    used.add((os.makedev(int(major, 16), int(minor, 16)), int(fields[4])))
    except (FileNotFoundError, ProcessLookupError):
        return set()  # exited meanwhile
    except OSError:
        return None  # not allowed to look
    return used
