"""Checkpoints in any fsspec filesystem (``memory://``, ``s3://`` via s3fs, ``gs://`` ...).

The manifest-last commit protocol and its invariants live in ``object_store.py``; this module
supplies the fsspec primitives. How atomic its "create-only" put is depends on the filesystem:
s3fs sends ``If-None-Match: *`` (AWS S3, moto and most S3-compatible stores honour it);
``memory://`` checks and sets in one call; other filesystems get check-then-write, so
``commit`` also checks for the manifest first (``check_before_commit``).

Throttling, 5xx and connection errors of fsspec and its client libraries become
``TransientStorageError`` (retried); missing files become ``CheckpointNotFoundError``. Options
other than ``MPCKPT_OPTIONS`` are handed to fsspec as storage options; values of those whose
name suggests a credential are scrubbed from every message.
"""

from __future__ import annotations

import errno
import inspect
import posixpath
import secrets
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import fsspec
from fsspec.spec import AbstractBufferedFile

from mpckpt.errors import (
    CheckpointNotFoundError,
    ConfigError,
    MpckptError,
    StorageError,
    TransientStorageError,
)
from mpckpt.storage import _lease
from mpckpt.storage._redact import scrub
from mpckpt.storage._retry import PROGRAMMING_ERRORS, retry
from mpckpt.storage.base import Buffer, check_relpath
from mpckpt.storage.object_store import MPCKPT_OPTIONS as MPCKPT_OPTIONS  # the options mpckpt reads itself
from mpckpt.storage.object_store import ObjectStoreBackend

_READ_CHUNK = 64 << 20  # ranged reads in pieces: bounded temporary memory
_WRITE_CHUNK = 8 << 20  # fits s3fs's buffer so a big part never lands in it whole
_SECRET_WORDS = ("key", "secret", "token", "password", "credential", "sas", "connection", "session")
_TRANSIENT_ERRNOS = {errno.EBUSY, getattr(errno, "EREMOTEIO", errno.EIO), errno.ETIMEDOUT, errno.ECONNRESET,
                     errno.ECONNREFUSED, errno.ECONNABORTED, errno.EPIPE, errno.EAGAIN}
_TRANSIENT_TYPES = {"EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError", "ConnectTimeoutError",
                    "HTTPClientError", "ProxyConnectionError", "ResponseParserError", "IncompleteRead",
                    "ClientConnectionError", "ClientConnectorError", "ClientOSError", "ServerDisconnectedError",
                    "ServerTimeoutError", "ClientPayloadError", "FSTimeoutError"}
_TRANSIENT_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests",
                    "RequestTimeout", "InternalError", "ServiceUnavailable", "500", "502", "503", "504", "429"}


def _causes(e: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def is_transient(e: BaseException) -> bool:
    """Whether an error from fsspec or its client library is worth a retry."""
    for exc in _causes(e):
        if isinstance(exc, (TimeoutError, ConnectionError)):
            return True
        if any(cls.__name__ in _TRANSIENT_TYPES for cls in type(exc).__mro__):
            return True
        response = getattr(exc, "response", None)
        if isinstance(response, dict):  # botocore ClientError
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            code = response.get("Error", {}).get("Code")
            if (isinstance(status, int) and (status >= 500 or status == 429)) or code in _TRANSIENT_CODES:
                return True
        if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
            return True
    return False


def _secret_values(options: dict[str, Any]) -> list[str]:
    """String values of options whose name suggests a credential (searched recursively)."""
    found: list[str] = []
    for key, value in options.items():
        if isinstance(value, dict):
            found.extend(_secret_values(value))
        elif isinstance(value, str) and any(w in str(key).lower() for w in _SECRET_WORDS):
            found.append(value)
    return found


def _abandon(f: Any) -> None:
    """Drop a half-written file without publishing it (s3fs would otherwise upload on close)."""
    try:
        discard = getattr(f, "discard", None)
        if callable(discard):
            discard()
        if isinstance(f, AbstractBufferedFile):
            f.closed = True
        else:
            f.close()
    except Exception:  # noqa: BLE001 - cleanup must not hide the original error
        pass


class _FsspecLeaseStore:
    """The lease object through fsspec; ETag conditions on s3fs, write-then-verify elsewhere."""

    def __init__(self, backend: FsspecBackend) -> None:
        self._b = backend
        self._path = backend._key(_lease.LOCK_NAME)
        self.compare_and_swap = backend._is_s3

    def load(self) -> _lease.LeaseObject | None:
        def get() -> _lease.LeaseObject | None:
            self._b.fs.invalidate_cache(self._path)
            try:
                tag = self._b.fs.info(self._path).get("ETag")
                return _lease.LeaseObject(self._b.fs.cat_file(self._path), tag)
            except FileNotFoundError:
                return None
        return self._b._call(f"read the writer lease {self._b._show(_lease.LOCK_NAME)}", get)

    def _put(self, write: Callable[[], None]) -> None:
        def put() -> None:
            try:
                write()
            except FileExistsError as e:
                raise _lease.LeaseLost from e
            except OSError as e:
                if "PreconditionFailed" in repr(e.__cause__) or "pre-condition" in str(e):
                    raise _lease.LeaseLost from e
                raise
        self._b._call(f"write the writer lease {self._b._show(_lease.LOCK_NAME)}", put)

    def create(self, data: bytes) -> None:
        self._put(lambda: self._b.create_only(self._path, data))

    def replace(self, data: bytes, tag: str | None) -> None:
        condition = {"IfMatch": tag} if self.compare_and_swap and tag else {}
        self._put(lambda: self._b.fs.pipe_file(self._path, data, **condition))

    def remove(self, tag: str | None) -> None:
        self._b._call(f"delete the writer lease {self._b._show(_lease.LOCK_NAME)}",
                      lambda: self._b._rm_quiet(self._path))


class FsspecBackend(ObjectStoreBackend):
    """Checkpoints under one root URL of an fsspec filesystem."""

    # s3fs honours If-None-Match, but other filesystems and some S3-compatible stores do not
    check_before_commit = True

    def __init__(self, url: str, options: dict[str, Any] | None = None) -> None:
        super().__init__(url, options)
        fs_options = {k: v for k, v in self._options.items() if k not in self.own_options}
        self._secrets = _secret_values(self._options)
        try:
            self.fs, root = fsspec.core.url_to_fs(url, **fs_options)
        except (ImportError, ValueError, TypeError) as e:
            raise ConfigError(f"{self.url}: cannot open this filesystem ({scrub(str(e), self._secrets)}); "
                              "check the URL scheme, install its fsspec package, and check the storage options") from e
        self._root = root.rstrip("/")
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        self._is_s3 = "s3" in protocols
        # memory:// lives inside this process: uploaders must be threads to see the same files
        self.process_local = "memory" in protocols
        try:
            self._native_create = "mode" in inspect.signature(self.fs.pipe_file).parameters
        except (TypeError, ValueError):
            self._native_create = False

    # -- primitives (the protocol itself is ObjectStoreBackend's) ------------------------
    def _translate(self, e: Exception, what: str) -> MpckptError:
        detail = scrub(f"{type(e).__name__}: {e}", self._secrets)
        if isinstance(e, FileNotFoundError):
            return CheckpointNotFoundError(f"{what}: it does not exist ({detail})")
        if is_transient(e):
            return TransientStorageError(f"{what}: {detail}")
        if isinstance(e, PermissionError):
            return StorageError(f"{what}: permission denied ({detail}); check the credentials and bucket policy")
        return StorageError(f"{what}: {detail}")

    def create_only(self, path: str, data: bytes) -> None:
        """Write ``data`` at ``path`` unless something is there (``FileExistsError`` then).

        Uses the filesystem's own ``pipe_file(mode="create")`` where it has one (s3fs sends
        If-None-Match, which the store evaluates atomically); elsewhere check-then-write, which a
        writer racing within one round trip could pass.
        """
        if self._native_create:
            self.fs.pipe_file(path, data, mode="create")
            return
        self.fs.invalidate_cache(path)
        if self.fs.exists(path):
            raise FileExistsError(path)
        self.fs.pipe_file(path, data)

    def _create_object(self, relpath: str, data: bytes) -> None:
        # only commit calls this, for the manifest (INVARIANT: manifest is written last)
        self.create_only(self._key(relpath), data)

    def _get_object(self, relpath: str) -> bytes:
        return bytes(self.fs.cat_file(self._key(relpath)))

    def _rm_quiet(self, path: str, recursive: bool = False) -> None:
        try:
            self.fs.rm(path, recursive=recursive)
        except FileNotFoundError:
            pass
        self.fs.invalidate_cache(path)

    def _delete_object(self, relpath: str) -> None:
        self._rm_quiet(self._key(relpath))

    def _delete_prefix(self, relpath: str, what: str) -> None:
        path = self._key(relpath)
        self._call(what, lambda: self._rm_quiet(path, recursive=True))

    def _copy_prefix(self, relpath: str, to: str) -> None:
        source, target = self._key(relpath), self._key(to)

        def copy() -> None:
            self.fs.invalidate_cache(source)
            for path in self.fs.find(source):  # every object below, however deep (files/ of a directory checkpoint)
                self.fs.copy(path, target + path[len(source):])
        self._call(f"copy {self._show(relpath)} to {self._show(to)}", copy)

    def _upload(self, relpath: str, local_path: str) -> None:
        path = self._key(relpath)
        self._call(f"upload {local_path} to {self._show(relpath)}", lambda: self.fs.put_file(local_path, path))

    def _lease_store(self) -> _FsspecLeaseStore:
        return _FsspecLeaseStore(self)

    # -- set-up --------------------------------------------------------------------------
    def check_writable(self) -> None:
        probe = self._key(f".mpckpt.probe.{secrets.token_hex(4)}")

        def attempt() -> None:
            try:
                if self._create:
                    self.fs.makedirs(self._root, exist_ok=True)
                self.fs.pipe_file(probe, b"mpckpt write probe")
            except (FileNotFoundError, PermissionError, *PROGRAMMING_ERRORS):
                raise
            except Exception as e:
                if is_transient(e):  # an outage as a job restarts is retried as any write is, not a wrong URL
                    raise TransientStorageError(f"{type(e).__name__}: {e}") from e
                raise

        try:
            retry(attempt, what=f"write a probe to {self.url}", attempts=self._attempts)
            self._rm_quiet(probe)
        except TransientStorageError as e:
            cause = e.__cause__.__cause__ if isinstance(e.__cause__, TransientStorageError) else e.__cause__
            raise ConfigError(f"{self.url} is not writable: {scrub(f'{type(cause).__name__}: {cause}', self._secrets)}; "
                              "cannot reach the storage endpoint; check the endpoint URL and the network") from e
        except FileNotFoundError as e:
            bucket = self._root.split("/")[0]
            example = f" (for example `aws s3 mb s3://{bucket}`)" if self._is_s3 else ""
            raise ConfigError(f"{self.url}: the bucket {bucket!r} does not exist; create it{example} "
                              "or pass the storage option create=True") from e
        except PermissionError as e:
            raise ConfigError(f"{self.url}: no permission to write ({scrub(str(e), self._secrets)}); "
                              "check the credentials and the bucket policy") from e
        except Exception as e:
            if isinstance(e, PROGRAMMING_ERRORS):
                raise
            hint = ("cannot reach the storage endpoint; check the endpoint URL and the network"
                    if is_transient(e) else "check the URL, credentials and storage options")
            raise ConfigError(f"{self.url} is not writable: {scrub(f'{type(e).__name__}: {e}', self._secrets)}; "
                              f"{hint}") from e

    # -- writing ------------------------------------------------------------------------
    def write_file(self, relpath: str, parts: Sequence[Buffer]) -> None:
        path = self._key(relpath)

        def put() -> None:
            f = self.fs.open(path, "wb")
            try:
                for part in parts:
                    view = memoryview(part).cast("B")
                    for pos in range(0, len(view), _WRITE_CHUNK):
                        f.write(view[pos:pos + _WRITE_CHUNK])
            except BaseException:
                _abandon(f)
                raise
            f.close()
        self._call(f"write {self._show(relpath)}", put)

    # -- reading ------------------------------------------------------------------------
    def list_names(self) -> list[str]:
        def ls() -> list[str]:
            self.fs.invalidate_cache(self._root)
            try:
                entries = self.fs.ls(self._root, detail=True)
            except FileNotFoundError:
                return []
            return sorted(posixpath.basename(e["name"].rstrip("/")) for e in entries if e.get("type") == "directory")
        return self._call(f"list {self.url}", ls)

    def list_files(self, folder: str) -> list[str]:
        path = self._key(folder)
        rel = check_relpath(folder)

        def ls() -> list[str]:
            self.fs.invalidate_cache(path)
            try:
                entries = self.fs.ls(path, detail=True)
            except FileNotFoundError:
                return []
            return sorted(f"{rel}/{posixpath.basename(e['name'].rstrip('/'))}" for e in entries
                          if e.get("type") == "file")
        return self._call(f"list {self._show(folder)}", ls)

    def read_bytes(self, relpath: str, *, max_bytes: int | None = None) -> bytes:
        path = self._key(relpath)
        what = f"read {self._show(relpath)}"
        if max_bytes is None:
            return self._call(what, lambda: self.fs.cat_file(path))
        size = self.size(relpath)  # a bigger file is refused unread
        if size <= max_bytes:
            # a ranged read: bounded even if the file was replaced by a bigger one since
            data = self._call(what, lambda: self.fs.cat_file(path, start=0, end=max_bytes + 1)) if size else b""
            if len(data) <= max_bytes:
                return bytes(data)
        found = f"{size} bytes" if size > max_bytes else f"more than {max_bytes} bytes (it grew while read)"
        raise self._too_big(relpath, found, max_bytes)

    def _read_range(self, relpath: str, start: int, length: int) -> bytes:
        """Up to ``length`` bytes from ``start``; fewer (maybe none) where the file ends first."""
        path = self._key(relpath)
        try:
            return self._call(f"read {self._show(relpath)} at {start}",
                              lambda: self.fs.cat_file(path, start=start, end=start + length))
        except StorageError as e:
            if isinstance(e, CheckpointNotFoundError) or self.size(relpath) >= start + length:
                raise
            return b""  # a range starting past the end is refused by some stores (HTTP 416)

    def read_into(self, relpath: str, offset: int, out: memoryview) -> None:
        view = out.cast("B")
        for pos in range(0, len(view), _READ_CHUNK):
            want = min(_READ_CHUNK, len(view) - pos)
            start = offset + pos
            data = self._read_range(relpath, start, want)
            if len(data) < want:
                raise self._truncated(relpath, offset + len(view), start + len(data))
            view[pos:pos + want] = data

    def size(self, relpath: str) -> int:
        path = self._key(relpath)

        def info() -> int:
            self.fs.invalidate_cache(path)
            entry = self.fs.info(path)
            if entry.get("type") == "directory":
                raise FileNotFoundError(path)
            return int(entry["size"])
        return self._call(f"stat {self._show(relpath)}", info)

    def exists(self, relpath: str) -> bool:
        path = self._key(relpath)

        def exists() -> bool:
            self.fs.invalidate_cache(path)
            return bool(self.fs.exists(path))
        return self._call(f"check {self._show(relpath)}", exists)
