"""The files of kept snapshots in /dev/shm: naming, the keeper's lock, publishing, finding, removing.

The snapshots kept for root R and rank r by user U live under one base name::

    mpckpt-kept-<U>-<key>-r<r>.lock            held (flock) by the live process keeping for R, r
    mpckpt-kept-<U>-<key>-r<r>.<step>.record   the record of step's snapshot (``record``): exists
                                               only for a complete snapshot
    mpckpt-kept-<U>-<key>-r<r>-<32 hex>        its data: a second name (hard link) of the slab holding it

A rank of a job holds more than one step at a time (``keeper``: its newest, and the newest step
every rank holds until a newer one is), each a record and its data; a single process holds one.

``key`` is the first 16 hex digits of the SHA-256 of R's URL; the record names R in full and is
checked against it. A copy of another node's rank r held here for it (``_peer``) has the same
three names with ``mpckpt-peer-`` in front: held by the process that received it, published the
same way, never mistaken for this node's own rank r. These names are outside the segment names the reaper judges
(``_system.shm``): a kept snapshot outlives its process (that is its purpose) and no process of
another root ever removes, reads or trusts it. The slab keeps its own name, which the
uploaders attach to; when its process dies, the reaper unlinks that name and the data stays
reachable through the kept one.

Publishing a snapshot: link its slab under a new data name, write the record to a temporary
name and rename it into place (atomic). Dropping one: unlink its record, then its data. A
crash at any point leaves every record with its data; a data name no record lists is removed by
the next holder. Only the holder of the lock publishes, adopts or removes; readers (the other
ranks of a job on this node) only read.

Everything here is opened without following links and used only when it is a regular file of
this user with mode 0600; anything else is ignored with a warning, and storage is used.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import mmap
import os
import re
import secrets
import stat
import threading
from dataclasses import dataclass

from mpckpt._keep.record import MAX_RECORD_BYTES, KeptRecord
from mpckpt._system.shm import SHM_DIR
from mpckpt.errors import CorruptCheckpointError
from mpckpt.storage._localfs import pread_into

log = logging.getLogger("mpckpt")

PREFIX = "mpckpt-kept-"
PEER_PREFIX = "mpckpt-peer-"  # copies of another node's snapshots, held here (``_peer``)
_BASE_RE = re.compile(r"mpckpt-(kept|peer)-([0-9]{1,10})-([0-9a-f]{16})-r([0-9]{1,6})")
_IOV_MAX = 512  # pieces per writev (the system allows at least 1,024)
_DATA_RE = re.compile(r"(mpckpt-(?:kept|peer)-[0-9]{1,10}-[0-9a-f]{16}-r[0-9]{1,6})-[0-9a-f]{32}")
_RECORD_RE = re.compile(r"(mpckpt-(?:kept|peer)-[0-9]{1,10}-[0-9a-f]{16}-r[0-9]{1,6})(?:\.([0-9]{1,20}))?\.record")


def root_key(url: str) -> str:
    return hashlib.sha256(url.encode()).hexdigest()[:16]


def root_key_of(base: str) -> str | None:
    """The ``root_key`` a kept snapshot's ``base`` name carries (None: not such a name)."""
    m = _BASE_RE.fullmatch(base)
    return None if m is None else m.group(3)


def base_name(url: str, rank: int, uid: int | None = None, prefix: str = PREFIX) -> str:
    return f"{prefix}{os.geteuid() if uid is None else uid}-{root_key(url)}-r{rank}"


def record_name(base: str, step: int) -> str:
    """The name of the record of ``step``'s snapshot under ``base``."""
    return f"{base}.{step}.record"


def record_names(base: str) -> list[str]:
    """The records under ``base`` now in /dev/shm (by step, oldest first; a record of an older
    mpckpt, named without its step, first)."""
    found = []
    for name in _listdir():
        m = _RECORD_RE.fullmatch(name)
        if m is not None and m.group(1) == base:
            found.append((-1 if m.group(2) is None else int(m.group(2)), name))
    return [name for _, name in sorted(found)]


def data_path(name: str) -> str:
    """Where a kept file ``name`` is (in /dev/shm, the segments' folder)."""
    return _path(name)


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def _open_checked(name: str, flags: int = os.O_RDONLY) -> tuple[int, os.stat_result]:
    """``name`` in /dev/shm opened without following a link, if it is a regular file of this user
    with mode 0600; ``OSError`` (EPERM) naming what is wrong otherwise."""
    fd = os.open(_path(name), flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EPERM, f"{_path(name)} is not a regular file")
        if st.st_uid != os.geteuid():
            raise OSError(errno.EPERM, f"{_path(name)} belongs to user {st.st_uid}, not to this user")
        if stat.S_IMODE(st.st_mode) != 0o600:
            raise OSError(errno.EPERM, f"{_path(name)} has mode {stat.S_IMODE(st.st_mode):o}, not 600")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


class Found:
    """A kept snapshot found in /dev/shm: its record and an open descriptor of its data.

    Reads go through ``read_into`` (``preadv``: the kernel copies from the shared pages, with no
    page table of a mapping to fault in, and a file truncated meanwhile is a short read, not a
    SIGBUS); ``data`` maps it read-only, made only when asked (a peer server sends from it).
    """

    def __init__(self, record: KeptRecord, fd: int, path: str) -> None:
        self.record = record
        self.path = path  # of the record, for messages
        self._fd = fd
        self._map: mmap.mmap | None = None
        self._lock = threading.Lock()

    def read_into(self, start: int, out: memoryview) -> None:
        """Fill ``out`` with bytes ``[start, start + len(out))`` of the data (in the record's bounds)."""
        view = out.cast("B")
        got = pread_into(self._fd, view, start)  # (the GIL released)
        if got < len(view):
            raise CorruptCheckpointError(f"{_path(self.record.data)} ends at {start + got}, before the "
                                         f"{start + len(view)} bytes the record says it holds (truncated)")

    @property
    def data(self) -> mmap.mmap:
        """A read-only map of the data (made at the first use)."""
        with self._lock:
            if self._map is None:
                # private and writable only so that ctypes can take its address: never written
                self._map = mmap.mmap(self._fd, self.record.data_size, mmap.MAP_PRIVATE,
                                      mmap.PROT_READ | mmap.PROT_WRITE) if self.record.data_size else mmap.mmap(-1, 1)
            return self._map

    def close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, -1
            if fd >= 0:
                os.close(fd)
            if self._map is not None:
                try:
                    self._map.close()
                except BufferError:
                    pass  # a view of it is still alive; the mapping goes with it


def read_kept(url: str, rank: int, world_size: int, prefix: str = PREFIX) -> list[Found]:
    """The complete snapshots kept for root ``url`` and ``rank`` on this node (``PEER_PREFIX``: the
    peer copies of that rank held here), checked, oldest first; one that cannot be used is left
    out with a warning saying why (storage is used for it)."""
    base = base_name(url, rank, prefix=prefix)
    out = []
    for name in record_names(base):
        found = _read_one(name, url, rank, world_size, base)
        if found is not None:
            out.append(found)
    return out


def _load_record(name: str) -> KeptRecord:
    """The record ``name`` in /dev/shm, parsed and checked (``OSError``, ``CorruptCheckpointError``)."""
    fd, st = _open_checked(name)
    try:
        if st.st_size > MAX_RECORD_BYTES:
            raise CorruptCheckpointError(f"{_path(name)} is {st.st_size} bytes, more than a record can be")
        with os.fdopen(os.dup(fd), "rb") as f:
            return KeptRecord.from_bytes(f.read(MAX_RECORD_BYTES + 1), path=_path(name))
    finally:
        os.close(fd)


def _read_one(name: str, url: str, rank: int, world_size: int, base: str) -> Found | None:
    """The kept snapshot of the record ``name``, checked; None (with a warning saying why) if unusable."""
    try:
        record = _load_record(name)
        why = _mismatch(record, url, rank, world_size, base)
        if not why and name not in (record_name(base, record.step), base + ".record"):
            why = f"it holds step {record.step}, not the step its name says"
        if why:
            raise CorruptCheckpointError(f"{_path(name)}: {why}")
        data_fd, data_st = _open_checked(record.data)
        if data_st.st_size < record.data_size:
            os.close(data_fd)
            raise CorruptCheckpointError(f"{_path(record.data)} is {data_st.st_size} bytes, the record says "
                                         f"{record.data_size} (truncated)")
        # (a pending record: its process died before the checksums were in it; the restore that
        # reads it computes them: ``source.MemorySource.learn``, ``Keeper.settle``)
        return Found(record, data_fd, _path(name))
    except (OSError, CorruptCheckpointError) as e:
        if isinstance(e, FileNotFoundError) and e.filename == _path(name):
            return None  # (the record removed meanwhile: by its holder, or gc)
        text = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        log.warning("mpckpt: the snapshot kept in memory for %s (rank %d) is ignored, storage is used: %s", url,
                    rank, text)
        return None


def _mismatch(record: KeptRecord, url: str, rank: int, world_size: int, base: str) -> str:
    if record.uid != os.geteuid():
        return f"it is user {record.uid}'s"
    if record.root != url:
        return f"it is a snapshot of {record.root!r}, not of {url!r}"
    if record.rank != rank or record.world_size != world_size:
        return f"it is rank {record.rank} of {record.world_size}, not rank {rank} of {world_size}"
    m = _DATA_RE.fullmatch(record.data)
    if m is None or m.group(1) != base:
        return f"its data {record.data!r} is not named as this root's"
    return ""


_held_locks: set[int] = set()  # descriptors of the locks this process holds


def _after_fork_in_child() -> None:
    """A fork child shares the parent's locked file descriptions: close its copies, hold nothing
    (a flock lives as long as any descriptor of it: a forked uploader would keep the lock)."""
    for fd in list(_held_locks):
        try:
            os.close(fd)
        except OSError:
            pass
    _held_locks.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


class KeptStore:
    """The kept snapshot of one root and rank on this node, for the process that holds it."""

    def __init__(self, url: str, rank: int, prefix: str = PREFIX) -> None:
        self.url, self.rank = url, rank
        self.base = base_name(url, rank, prefix=prefix)
        self._lock_fd: int | None = None

    def hold(self, *, quiet: bool = False) -> bool:
        """Take the lock of this root and rank; False (logged unless ``quiet``) when another live
        process holds it or the lock file is not ours."""
        name = self.base + ".lock"
        try:
            fd = os.open(_path(name), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as e:
            log.warning("mpckpt: cannot keep snapshots in memory for %s: %s: %s", self.url, _path(name), e.strerror)
            return False
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) != 0o600:
                raise OSError(errno.EPERM, "it is not a regular file of this user with mode 600")
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            held = e.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
            if quiet and held:
                return False
            log.warning("mpckpt: cannot keep snapshots in memory for %s: %s", self.url,
                        "another live process keeps them" if held else f"{_path(name)}: {e.strerror}")
            return False
        self._lock_fd = fd
        _held_locks.add(fd)
        return True

    @property
    def held(self) -> bool:
        return self._lock_fd is not None

    def publish(self, record: KeptRecord, slab_name: str) -> None:
        """Keep ``record`` (its data: the slab ``slab_name``) beside the snapshots already kept."""
        assert self.held
        os.link(_path(slab_name), _path(record.data))
        self.publish_record(record)

    def publish_record(self, record: KeptRecord, *, again: bool = False) -> None:
        """Put ``record`` in place (its data file ``record.data`` is complete): a record of the same
        step is replaced, and the data it named goes. A failure removes ``record.data``, unless
        ``again`` (the record of the data already in place, written once more: a pending one with
        its checksums), which leaves both as they were."""
        assert self.held
        name = record_name(self.base, record.step)
        try:
            tmp = f"{name}.tmp-{secrets.token_hex(8)}"
            fd = os.open(_path(tmp), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                _write_all(fd, record.to_pieces())
            finally:
                os.close(fd)
            replaced = None if again else self._data_of(name)  # (again: the data in place is record.data)
            os.rename(_path(tmp), _path(name))  # INVARIANT: after the last byte
        except BaseException:
            if not again:
                _unlink(record.data)
            raise
        if replaced is not None and replaced != record.data:
            _unlink(replaced)

    def _data_of(self, name: str) -> str | None:
        """The data name the record ``name`` lists (None: no such record, or unreadable)."""
        try:
            return _load_record(name).data
        except (OSError, CorruptCheckpointError):
            return None

    def drop(self, record: KeptRecord) -> None:
        """Remove the kept snapshot ``record``: its record first (it is then no longer complete),
        then its data."""
        if self.held:
            _unlink(record_name(self.base, record.step))
            _unlink(record.data)

    def new_data_name(self) -> str:
        return f"{self.base}-{secrets.token_hex(16)}"

    def remove_data(self, keep: set[str] | frozenset[str] = frozenset()) -> None:
        """Unlink every data name of this root and rank but those in ``keep`` (and stray temporary
        records)."""
        for name in _listdir():
            m = _DATA_RE.fullmatch(name)
            if (m is not None and m.group(1) == self.base and name not in keep) or \
                    (name.startswith(self.base + ".") and ".record.tmp-" in name):
                _unlink(name)

    def tidy(self, found: list[Found]) -> None:
        """After reading them at open (``found``: what checked): remove every other record, stray
        temporary records and the data no found record lists."""
        if not self.held:
            return
        good = {f.path for f in found}
        for name in record_names(self.base):
            if _path(name) not in good:
                _unlink(name)
        self.remove_data(keep={f.record.data for f in found})

    def discard(self) -> None:
        """Remove every kept snapshot: the records first (they are then no longer complete), then the data."""
        if self.held:
            for name in record_names(self.base):
                _unlink(name)
            self.remove_data()

    def release(self, *, leave: bool) -> None:
        """Let go of the lock; unless ``leave``, remove the kept snapshot and the lock file first."""
        if self._lock_fd is None:
            return
        if not leave:
            self.discard()
            _unlink(self.base + ".lock")  # INVARIANT: removed while still locked
        _held_locks.discard(self._lock_fd)
        os.close(self._lock_fd)
        self._lock_fd = None


def _write_all(fd: int, pieces: list[bytes]) -> None:
    """Write ``pieces`` one after the other, a bounded number per ``writev`` (whose short writes are
    carried on from where they stopped)."""
    at = 0
    while at < len(pieces):
        batch = pieces[at:at + _IOV_MAX]
        done = os.writev(fd, batch)
        for piece in batch:
            if done < len(piece):
                if done:
                    pieces[at] = piece[done:]
                break
            done -= len(piece)
            at += 1


def _unlink(name: str) -> None:
    try:
        os.unlink(_path(name))
    except FileNotFoundError:
        pass


def _listdir() -> list[str]:
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith((PREFIX, PEER_PREFIX)))
    except OSError:
        return []


def peer_ranks(url: str) -> list[int]:
    """The ranks of root ``url`` with a copy held on this node for this user (``PEER_PREFIX``)."""
    uid, key = str(os.geteuid()), root_key(url)
    out = set()
    for name in _listdir():
        r = _RECORD_RE.fullmatch(name)
        m = _BASE_RE.fullmatch(r.group(1)) if r is not None else None
        if m is not None and m.group(1) == "peer" and m.group(2) == uid and m.group(3) == key:
            out.add(int(m.group(4)))
    return sorted(out)


@dataclass
class Listed:
    """A kept snapshot of this user as ``mpckpt gc`` sees it."""

    base: str
    root: str | None   # None when its record is missing or unreadable
    rank: int
    step: int | None   # the newest step kept (``steps``: every one)
    nbytes: int        # of its files in /dev/shm
    held: bool         # a live process keeps it (its lock is held)
    peer: bool = False  # a copy of another node's rank held here (``mpckpt-peer-``)
    steps: tuple[int, ...] = ()


def list_kept() -> list[Listed]:
    """Every kept snapshot of this user on this node (another user's are never looked at)."""
    uid = str(os.geteuid())
    bases: dict[str, int] = {}
    for name in _listdir():
        m = _BASE_RE.match(name)
        if m is None or m.group(2) != uid:
            continue
        try:
            st = os.lstat(_path(name))
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
            bases[m.group(0)] = bases.get(m.group(0), 0) + st.st_blocks * 512
    out = []
    for base, nbytes in sorted(bases.items()):
        root = None
        steps = []
        for name in record_names(base):
            try:
                record = _load_record(name)
                root = record.root
                steps.append(record.step)
            except (OSError, CorruptCheckpointError):
                pass
        m = _BASE_RE.fullmatch(base)
        assert m is not None
        out.append(Listed(base, root, int(m.group(4)), max(steps, default=None), nbytes, _lock_held(base),
                          m.group(1) == "peer", tuple(sorted(steps))))
    return out


def _lock_held(base: str) -> bool:
    try:
        fd = os.open(_path(base + ".lock"), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return False
    except OSError:
        return True  # not ours to judge: treated as held, never removed
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def remove_kept(base: str) -> bool:
    """Remove the kept snapshot ``base`` of this user unless a live process holds it."""
    m = _BASE_RE.fullmatch(base)
    if m is None or m.group(2) != str(os.geteuid()):
        return False
    lock = base + ".lock"
    try:
        fd = os.open(_path(lock), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        for name in _listdir():
            d = _DATA_RE.fullmatch(name)
            r = _RECORD_RE.fullmatch(name.split(".tmp-")[0])
            if (r is not None and r.group(1) == base) or (d is not None and d.group(1) == base):
                _unlink(name)
        _unlink(lock)
        return True
    finally:
        os.close(fd)
