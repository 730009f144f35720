"""The manifest-last commit protocol on object stores, shared by every backend without rename.

``ObjectStoreBackend`` owns what the fsspec and Azure backends do the same way; a subclass
supplies only the primitives that differ (put, get, list and delete of objects, the
create-only put, the client set-up and the translation of its client's errors).

Protocol (an object store has no rename, so nothing can be published by moving it):

* ``staging_name(name)`` is ``name`` itself: data files are written straight to their final
  keys, and there are no folders to create (``prepare_staging`` does nothing). It makes no
  request (it runs inside ``save()`` on the training thread), so it does not look for a
  manifest either: a taken name is
  refused by ``commit`` alone. That is safe because the single-writer lease keeps other
  writers out and a writer never reuses a step it committed (steps only increase), so data
  files are never written under a committed checkpoint. Leftovers of a failed attempt are
  removed by ``abort`` and, after a crash, by the ledger's recovery scan at the next open
  (through ``delete``).
* ``commit`` writes ``manifest.json`` last, with a create-only condition: ``If-None-Match: *``
  where the store evaluates it atomically (S3 through s3fs, Azure), otherwise check-then-write.
  A commit whose earlier attempt landed before its reply was lost recognises its own manifest
  and succeeds; any other manifest already there is ``CommitConflictError`` and stays as it is.
* ``abort`` never removes a committed checkpoint (by us or another writer), and is quiet when
  nothing was written; ``delete`` removes the manifest first, so the checkpoint stops
  existing at once even if the rest fails.
* ``adopt_folder`` (``mode=NO_UPLOAD``) is refused: moving a local folder needs a local root.
* ``cleanup_incomplete`` has nothing to do: a staging folder *is* the checkpoint's name, and
  the ledger deletes folders without a manifest.
* Shared files (``shared/<never used name>``) are written once, straight to their final key,
  before a manifest lists them: no rename is needed, and a file written for a save that
  never commits is found again by ``list_files("shared")`` and deleted (``delete_file``).

Invariants: a folder without a manifest is never listed as a checkpoint nor loaded, so a
half-written checkpoint never exists; a committed manifest is never replaced. How atomic
"create-only" is depends on the store: check-then-write could let two writers racing within
one round trip both pass, and the single-writer lease (``_lease.py``) is what keeps two
writers apart in the first place.

Every client call goes through ``_call``: errors become the ``mpckpt.errors`` tree
(``CheckpointNotFoundError``, ``TransientStorageError`` ...) through the subclass's
``_translate``, and transient ones are retried with backoff by ``_retry.retry``. Storage
options may hold credentials: they never appear in ``url``, reprs or messages (``_redact``).
"""

from __future__ import annotations

import abc
import os
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

from mpckpt.errors import (
    CheckpointNotFoundError,
    CommitConflictError,
    ConfigError,
    CorruptCheckpointError,
    MpckptError,
)
from mpckpt.storage import _lease
from mpckpt.storage._redact import redact_url
from mpckpt.storage._retry import DEFAULT_ATTEMPTS, PROGRAMMING_ERRORS, retry
from mpckpt.storage.base import MANIFEST_NAME, BackendSpec, check_relpath

T = TypeVar("T")
B = TypeVar("B", bound="ObjectStoreBackend")

#: Options every object store reads itself (a subclass may add its own to ``own_options``).
MPCKPT_OPTIONS = ("create", "lease_s", "retry_attempts")


def positive_int(options: Mapping[str, Any], key: str, default: int) -> int:
    """The storage option ``key`` as a positive int, or ``ConfigError`` naming it."""
    value = options.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"storage option {key}={value!r} must be a positive integer")
    return value


class ObjectStoreBackend(abc.ABC):
    """Checkpoints under one key prefix (``_root``) of an object store without rename."""

    #: The options mpckpt reads itself; the rest belong to the client (or are refused).
    own_options: ClassVar[tuple[str, ...]] = MPCKPT_OPTIONS
    #: The errors of the client that ``_call`` translates; anything else passes unchanged.
    client_errors: ClassVar[tuple[type[Exception], ...]] = (Exception,)
    #: The errors the create-only put raises when the object is already there.
    exists_errors: ClassVar[tuple[type[Exception], ...]] = (FileExistsError,)
    #: Whether ``commit`` checks for the manifest before its create-only put (for stores
    #: whose create-only condition may be ignored or is itself check-then-write).
    check_before_commit: ClassVar[bool] = False

    def __init__(self, url: str, options: Mapping[str, Any] | None = None) -> None:
        self._options = dict(options or {})
        self._spec_root = url
        self._scheme = url.partition("://")[0].lower()
        self.url = redact_url(url).rstrip("/")
        self._root = ""  # the key prefix of the checkpoint root; set by the subclass
        self._create = bool(self._options.get("create", False))
        self._lease_s = _lease.parse_lease_s(self._options.get("lease_s", _lease.DEFAULT_LEASE_S))
        self._attempts = positive_int(self._options, "retry_attempts", DEFAULT_ATTEMPTS)
        self._secrets: list[str] = []  # values scrubbed from every message; set by the subclass

    @classmethod
    def from_spec(cls: type[B], spec: BackendSpec) -> B:
        return cls(spec.root, spec.options)

    def spec(self) -> BackendSpec:
        return BackendSpec(self._scheme, self._spec_root, dict(self._options))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    # -- what a subclass implements -----------------------------------------------------
    @abc.abstractmethod
    def _translate(self, e: Exception, what: str) -> MpckptError:
        """The ``mpckpt.errors`` equivalent of a client error (``TransientStorageError`` retries)."""

    @abc.abstractmethod
    def _create_object(self, relpath: str, data: bytes) -> None:
        """Put ``data`` unless an object is there (one of ``exists_errors`` then); one request."""

    @abc.abstractmethod
    def _get_object(self, relpath: str) -> bytes:
        """The whole object; one request, errors untranslated."""

    @abc.abstractmethod
    def _delete_object(self, relpath: str) -> None:
        """Delete one object (nothing if it is missing); one request, errors untranslated."""

    @abc.abstractmethod
    def _delete_prefix(self, relpath: str, what: str) -> None:
        """Delete every object under ``relpath/``, through ``_call`` (``what`` names the job)."""

    @abc.abstractmethod
    def _copy_prefix(self, relpath: str, to: str) -> None:
        """Copy every object under ``relpath/`` to the same name under ``to/`` (server side), through ``_call``."""

    @abc.abstractmethod
    def _upload(self, relpath: str, local_path: str) -> None:
        """Copy the existing local file ``local_path`` to ``relpath``, through ``_call``."""

    @abc.abstractmethod
    def _lease_store(self) -> _lease.LeaseStore:
        """The lease object of this root with the strongest conditions the store offers."""

    @abc.abstractmethod
    def exists(self, relpath: str) -> bool:
        """Whether an object exists at ``relpath``."""

    @abc.abstractmethod
    def list_files(self, folder: str) -> list[str]:
        """Paths of the objects directly under ``folder/`` (not deeper); ``[]`` if there are none."""

    # -- helpers ------------------------------------------------------------------------
    def _key(self, relpath: str) -> str:
        rel = check_relpath(relpath)
        return f"{self._root}/{rel}" if self._root else rel

    def _show(self, relpath: str) -> str:
        return f"{self.url}/{relpath}"

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """Run one client operation with error translation and bounded retries."""
        def attempt() -> T:
            try:
                return fn()
            except (MpckptError, _lease.LeaseLost, *PROGRAMMING_ERRORS):
                raise
            except self.client_errors as e:
                raise self._translate(e, what) from e
        return retry(attempt, what=what, attempts=self._attempts)

    def _read_quiet(self, relpath: str) -> bytes | None:
        try:
            return self._get_object(relpath)
        except Exception:  # noqa: BLE001 - only used to recognise our own write
            return None

    def _truncated(self, relpath: str, wanted_end: int, file_end: int) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self._show(relpath)} is truncated: wanted bytes up to {wanted_end}, "
                                      f"file ends at {file_end}", path=self._show(relpath))

    def _too_big(self, relpath: str, found: str, max_bytes: int) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self._show(relpath)} is {found}, above the {max_bytes} such a file may "
                                      "have; it is damaged or not written by mpckpt", path=self._show(relpath))

    # -- set-up -------------------------------------------------------------------------
    def acquire_writer_lock(self, owner: str) -> _lease.LeaseLock:
        lock = _lease.LeaseLock(self._lease_store(), owner=owner, where=self.url, lease_s=self._lease_s)
        return lock.acquire()

    # -- writing ------------------------------------------------------------------------
    def staging_name(self, name: str, *, run: str | None = None) -> str:
        check_relpath(name)  # no request: save() calls this; commit refuses a taken name
        return name

    def prepare_staging(self, staging: str) -> None:
        check_relpath(staging)  # no folders on an object store: nothing to make

    def upload_file(self, relpath: str, local_path: str) -> None:
        if not os.path.isfile(local_path):
            raise CheckpointNotFoundError(f"cannot upload {local_path}: it does not exist")
        self._upload(relpath, local_path)

    def adopt_folder(self, local_path: str, relpath: str) -> None:
        raise ConfigError(f"mode=NO_UPLOAD moves a local folder into place, which needs a local root: cannot "
                          f"move {local_path} to {self._show(relpath)}; with {self._scheme}:// use ASYNC or SYNC")

    def commit(self, staging: str, name: str, manifest: bytes) -> None:
        if check_relpath(staging) != check_relpath(name):
            raise ConfigError(f"{self.url}: object stores stage in place; staging {staging!r} must equal {name!r}")
        rel = f"{name}/{MANIFEST_NAME}"
        data = bytes(manifest)
        checked = self.check_before_commit
        if checked and self.exists(rel):  # also catches stores that ignore the create-only condition
            raise CommitConflictError(f"checkpoint {name} already exists in {self.url}; not replaced")
        retried = False

        def put() -> None:
            nonlocal retried
            try:
                # INVARIANT: the manifest is written last, create-only (If-None-Match: * where
                # the store has it).
                self._create_object(rel, data)
            except self.exists_errors as e:
                if retried and self._read_quiet(rel) == data:
                    return  # our own earlier attempt landed before its reply was lost
                found = "appeared in {} while committing" if checked else "already exists in {}"
                raise CommitConflictError(f"checkpoint {name} {found.format(self.url)}; not replaced") from e
            except Exception:
                retried = True
                raise
        self._call(f"commit {self._show(name)}", put)

    def abort(self, staging: str) -> None:
        if self.exists(f"{staging}/{MANIFEST_NAME}"):
            return  # committed (by us or another writer): never removed by an abort
        self._delete_prefix(staging, f"remove {self._show(staging)}")

    # -- housekeeping -------------------------------------------------------------------
    def delete(self, name: str) -> None:
        rel = f"{name}/{MANIFEST_NAME}"
        # INVARIANT: the manifest goes first, so the checkpoint stops existing at once.
        self._call(f"delete {self._show(rel)}", lambda: self._delete_object(rel))
        self._delete_prefix(name, f"delete {self._show(name)}")

    def set_aside(self, name: str, aside: str) -> None:
        # no rename on object stores: copy everything, then delete the original (manifest first)
        self._copy_prefix(name, aside)
        self.delete(name)

    def delete_file(self, relpath: str) -> None:
        self._call(f"delete {self._show(relpath)}", lambda: self._delete_object(relpath))

    def cleanup_incomplete(self) -> list[str]:
        return []  # staging is the final prefix; the ledger deletes manifest-less folders
