"""The one protocol every storage backend implements, and the spec that rebuilds it.

A backend stores checkpoints under one root. Every path it is given is *relative to that
root*, uses ``/`` and never escapes it (``check_relpath`` enforces this). A checkpoint is a
folder ``<name>/`` holding data files and, last, ``manifest.json``.

Two commit protocols exist because storages differ in what they make atomic:

* POSIX filesystems can rename a folder atomically, so ``staging_name`` names a temporary
  folder beside the destination, files are fsynced there, and ``commit`` writes the manifest,
  fsyncs and renames the folder into place.
* Object stores have no rename, so ``staging_name`` is the final prefix itself, data files are
  written there, and ``commit`` writes the manifest last with a create-only condition. Until
  the manifest exists the checkpoint does not exist for any reader.

Files several checkpoints use are written under ``shared/`` with names never used before
(``format.names.shared_path``), straight to their final place, durably (local disk also
syncs the folder entry), before any manifest lists them; they are never renamed or replaced,
so both protocols serve them as they are.

Either way: a checkpoint without a valid manifest is never listed or loaded, and ``commit``
raises ``CommitConflictError`` rather than replace a manifest that is already there. It is the
only place a taken name is refused: ``staging_name`` runs inside ``save()`` on the training
thread and does no I/O, and the staging folder is created by the first write under it.

Backends are created in the training process and, from their ``spec()``, again inside each
uploader process; a spec is a small picklable recipe (scheme, root, options). Options can
carry credentials: ``BackendSpec.__repr__`` never shows them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from mpckpt.format.names import MANIFEST_NAME, check_relpath  # noqa: F401 -- re-exported for backends

Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True)
class BackendSpec:
    """A picklable recipe for a backend: ``open_backend(spec)`` rebuilds it anywhere."""

    scheme: str
    root: str
    options: dict[str, Any] = field(default_factory=dict)
    factory: str | None = None  # "module:callable" of a registered backend (see register_backend)

    def __repr__(self) -> str:  # options may hold credentials: never print them
        return f"BackendSpec(scheme={self.scheme!r}, root={self.root!r}, options=<{len(self.options)} hidden>)"


@runtime_checkable
class Backend(Protocol):
    """Storage for one checkpoint root. Methods may be called from several threads."""

    #: A printable location (never contains credentials).
    url: str
    #: Optional (read with ``getattr(backend, "process_local", False)``): True when the
    #: storage exists only inside this process (fsspec ``memory://``), so uploaders must be
    #: threads of this process rather than separate processes.

    def spec(self) -> BackendSpec:
        """The recipe that rebuilds this backend in another process."""
        ...

    # -- set-up --------------------------------------------------------------------------
    def check_writable(self) -> None:
        """Fail now, with a clear error naming the URL, if checkpoints cannot be written."""
        ...

    # -- writing (uploader processes and the committer) -------------------------------
    def staging_name(self, name: str, *, run: str | None = None) -> str:
        """The folder (relative path) where checkpoint ``name``'s files go until ``commit``.

        ``run`` (letters and digits): the token of one open of the root by the ranks of a
        torch.distributed job, which all write into one staging folder; the same name for the
        same ``name`` and ``run`` on every rank (the writer lock's holder, rank 0, commits it).

        Pure: no I/O, so ``save()`` may call it on the training thread. ``ConfigError`` if
        ``name`` is not a valid checkpoint name. Nothing is created (``prepare_staging`` does)
        and nothing is checked: a committed ``name`` is refused by ``commit``. Local disk: a
        fresh ``.tmp.<name>.<pid>.<token>`` on every call; object stores: ``name`` itself.
        """
        ...

    def prepare_staging(self, staging: str) -> None:
        """Make the staging folder ``staging`` (idempotent), never through a link.

        Called in the training process, off the training thread (the pool's dispatcher before a
        checkpoint's first job is sent; the committer), before any file is written under it.
        ``write_file`` and ``upload_file`` never create a staging folder, so an uploader that
        outlives its trainer cannot bring back one that ``abort`` or a recovery scan removed.
        Object stores have no folders: nothing to do.
        """
        ...

    def write_file(self, relpath: str, parts: Sequence[Buffer]) -> None:
        """Write the concatenation of ``parts`` as one file, durably (fsync or equivalent).

        ``parts`` are usually memoryview slices of shared memory: never copy them whole.
        Overwrites a partial file left by an earlier attempt at the same path. Missing folders
        above it are created, never through a link, except the staging folder itself (see
        ``prepare_staging``): writing under one that is not there is a ``StorageError``.
        """
        ...

    def upload_file(self, relpath: str, local_path: str) -> None:
        """Copy a file from the local filesystem to ``relpath``, durably (folders as ``write_file``)."""
        ...

    def adopt_folder(self, local_path: str, relpath: str) -> None:
        """Move the local folder ``local_path`` to ``relpath`` (for ``mode=NO_UPLOAD``).

        Local disk only: one rename, never through a link: ``local_path`` must be a folder, not
        a link to one (``ConfigError``), and no folder below the root is followed. The folders
        above ``relpath`` are created. ``ConfigError`` naming both paths if ``local_path`` is on
        another filesystem than the root. Object stores raise ``ConfigError``: adopting a
        folder needs a local root.
        """
        ...

    def commit(self, staging: str, name: str, manifest: bytes) -> None:
        """Atomically publish ``staging`` as checkpoint ``name`` with ``manifest`` written last.

        INVARIANT: the manifest is the last thing written; on conflict nothing is replaced.
        """
        ...

    def abort(self, staging: str) -> None:
        """Remove what a failed attempt wrote under ``staging`` (never a committed manifest).

        Quiet when nothing was ever written there (the staging folder was never created).
        """
        ...

    # -- reading ------------------------------------------------------------------------
    # Reads never trust what is under the root: anyone who can write there, a crash or bit rot
    # may leave a link, a folder, a FIFO or a huge file where a checkpoint file should be.
    # Only regular files are read; on a filesystem, a symbolic link in any component below the
    # root (the root itself may be a link the user chose) is ``CorruptCheckpointError`` naming
    # the path and nothing about where the link points; so is a folder or special file where a
    # file should be. Nothing is ever found only by following a link.

    def list_names(self) -> list[str]:
        """Names of the top-level folders under the root (committed or not; never links)."""
        ...

    def list_files(self, folder: str) -> list[str]:
        """Paths (relative to the root) of the files directly in ``folder``; ``[]`` if there is none.

        Only regular files (never a link, never what is in a subfolder); ``shared/`` is the
        folder mpckpt lists, to find shared files no manifest lists any more.
        """
        ...

    def read_bytes(self, relpath: str, *, max_bytes: int | None = None) -> bytes:
        """A whole (small) file. ``CheckpointNotFoundError`` if it does not exist.

        With ``max_bytes``, a larger file is ``CorruptCheckpointError`` naming the path and
        both sizes, and is not read: memory stays bounded whatever is stored there.
        """
        ...

    def read_into(self, relpath: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with bytes ``[offset, offset + len(out))`` of the file.

        ``CorruptCheckpointError`` if the file is shorter than that.
        """
        ...

    def size(self, relpath: str) -> int:
        """Size in bytes of a file. ``CheckpointNotFoundError`` if it does not exist."""
        ...

    def exists(self, relpath: str) -> bool:
        """Whether a file exists (a link or folder in its place raises, as a read would)."""
        ...

    # -- housekeeping -------------------------------------------------------------------
    def delete(self, name: str) -> None:
        """Delete checkpoint folder ``name``: manifest first, so it stops existing at once.

        Never deletes through a link: a link at ``name`` is removed itself, never its target.
        """
        ...

    def set_aside(self, name: str, aside: str) -> None:
        """Move checkpoint folder ``name`` to the top-level folder ``aside`` (a damaged checkpoint
        a run went back past: kept, out of the way of the steps saved again).

        ``aside`` is no checkpoint name, so nothing reads it as one. A crash midway leaves
        ``name`` as it was (object stores copy every object, then delete ``name`` manifest first).
        """
        ...

    def delete_file(self, relpath: str) -> None:
        """Delete one file (a shared file no manifest lists any more); quiet when it is not there.

        A link there is removed itself, never its target; a folder there is not a file of ours
        and is left alone.
        """
        ...

    def cleanup_incomplete(self) -> list[str]:
        """Remove staging folders this backend's ``staging_name`` named; return their paths.

        Called at open while the writer lock is held, so no live writer owns them. Folders
        without a manifest under a checkpoint's own name are removed by the ledger through
        ``delete`` (on object stores a staging folder *is* that name).
        """
        ...

    def acquire_writer_lock(self, owner: str) -> WriterLock:
        """Take the single-writer lock of this root or raise ``LockedError``.

        A lock held by a dead process must not block forever: local disk uses ``flock``
        (released by the kernel), object stores a lease object that expires unless renewed.
        """
        ...


class WriterLock(Protocol):
    """A held single-writer lock; ``release`` is idempotent."""

    def renew(self) -> None:
        """Extend the lease (a no-op where the kernel tracks liveness)."""
        ...

    def release(self) -> None:
        """Give the lock up."""
        ...
