"""Checkpoints in Azure Blob Storage, natively on ``azure-storage-blob`` (``mpckpt[azure]``).

URLs: ``az://container/prefix``, ``abfs[s]://container@account.dfs.core.windows.net/prefix``
and ``abfs://container/prefix``. Credentials come from the storage options
(``connection_string``; or ``account_url``/``account_name`` with ``account_key``,
``sas_token`` or ``credential``), else from ``AZURE_STORAGE_CONNECTION_STRING`` /
``AZURE_STORAGE_ACCOUNT_NAME`` + ``AZURE_STORAGE_ACCOUNT_KEY`` or ``AZURE_STORAGE_SAS_TOKEN``,
else from ``azure.identity.DefaultAzureCredential`` when that package is installed. They never
appear in ``url``, reprs or messages.

Commit protocol (object store): ``stage(name)`` returns ``name``; shards are uploaded as
blocks straight from shared memory (memoryview slices, never one copy of the shard) in
parallel under deterministic block ids, so a retried block replaces its earlier attempt;
``commit_block_list`` publishes each shard. ``commit`` uploads ``manifest.json`` last with
``If-None-Match: *``, which Azure evaluates atomically: a committed manifest is never replaced.

The writer lock is the JSON lease of ``_lease.py`` kept with ETag conditions (atomic
compare-and-swap). Every request goes through ``_retry.retry``; the SDK's own retries are off
so there is exactly one retry policy.
"""

from __future__ import annotations

import io
import math
import os
import secrets
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any, TypeVar

from azure.core import MatchConditions
from azure.core.exceptions import (
    AzureError,
    ClientAuthenticationError,
    HttpResponseError,
    ResourceExistsError,
    ResourceModifiedError,
    ResourceNotFoundError,
    ServiceRequestError,
    ServiceResponseError,
)
from azure.storage.blob import BlobBlock, BlobServiceClient, ContainerClient

from mpckpt.errors import (
    CheckpointNotFoundError,
    CommitConflictError,
    ConfigError,
    CorruptCheckpointError,
    MpckptError,
    StorageError,
    TransientStorageError,
)
from mpckpt.storage import _lease
from mpckpt.storage._redact import redact_url, scrub
from mpckpt.storage._retry import DEFAULT_ATTEMPTS, PROGRAMMING_ERRORS, retry
from mpckpt.storage.base import MANIFEST_NAME, BackendSpec, Buffer, check_relpath

T = TypeVar("T")

DEFAULT_BLOCK_SIZE = 8 << 20
DEFAULT_CONCURRENCY = 8
MAX_BLOCKS = 50_000  # Azure's limit of blocks per blob
_CREDENTIAL_OPTIONS = ("connection_string", "account_url", "account_name", "account_key", "sas_token", "credential")
_MPCKPT_OPTIONS = ("create", "lease_s", "retry_attempts", "block_size", "max_concurrency", "client_kwargs")


def parse_url(url: str) -> tuple[str, str | None, str]:
    """``(container, account or None, prefix)`` of an ``az://`` / ``abfs[s]://`` URL."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in ("az", "abfs", "abfss"):
        raise ConfigError(f"{redact_url(url)} is not an Azure URL; use az://container/prefix")
    where, _, prefix = rest.partition("/")
    container, at, host = where.partition("@")
    account = host.split(".")[0] if at else None
    if not container or (at and not account):
        raise ConfigError(f"{redact_url(url)} names no container; use az://container/prefix "
                          "or abfs://container@account.dfs.core.windows.net/prefix")
    return container, account, prefix.strip("/")


def _positive_int(options: Mapping[str, Any], key: str, default: int) -> int:
    value = options.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"storage option {key}={value!r} must be a positive integer")
    return value


def service_client(url: str, options: Mapping[str, Any], environ: Mapping[str, str]) -> BlobServiceClient:
    """Build the service client from options, then environment, then DefaultAzureCredential."""
    _container, url_account, _prefix = parse_url(url)
    kwargs: dict[str, Any] = {"retry_total": 0, "connection_timeout": 30, **options.get("client_kwargs", {})}
    conn = options.get("connection_string")
    if conn:
        return BlobServiceClient.from_connection_string(conn, **kwargs)
    account = options.get("account_name") or url_account or environ.get("AZURE_STORAGE_ACCOUNT_NAME")
    account_url = options.get("account_url") or (f"https://{account}.blob.core.windows.net" if account else None)
    credential = options.get("credential") or options.get("sas_token")
    if credential is None and options.get("account_key"):
        credential = {"account_name": account, "account_key": options["account_key"]}
    if credential is None and not options.get("account_url"):
        env_conn = environ.get("AZURE_STORAGE_CONNECTION_STRING")
        if env_conn:
            return BlobServiceClient.from_connection_string(env_conn, **kwargs)
        if environ.get("AZURE_STORAGE_ACCOUNT_KEY"):
            credential = {"account_name": account, "account_key": environ["AZURE_STORAGE_ACCOUNT_KEY"]}
        elif environ.get("AZURE_STORAGE_SAS_TOKEN"):
            credential = environ["AZURE_STORAGE_SAS_TOKEN"]
    if account_url is None:
        raise ConfigError(f"{redact_url(url)}: no storage account; use abfs://container@ACCOUNT.dfs.core.windows.net/"
                          "or pass the storage option account_name (or set AZURE_STORAGE_ACCOUNT_NAME)")
    if credential is None:
        try:
            from azure.identity import DefaultAzureCredential
        except ImportError as e:
            raise ConfigError(
                f"{redact_url(url)}: no Azure credentials; pass the storage option connection_string or "
                "account_key / sas_token, set AZURE_STORAGE_CONNECTION_STRING, or install mpckpt[identity] "
                "to sign in with DefaultAzureCredential") from e
        credential = DefaultAzureCredential()
    return BlobServiceClient(account_url, credential=credential, **kwargs)


class _ViewStream(io.RawIOBase):
    """A seekable stream over a memoryview: request bodies and download targets without copies."""

    def __init__(self, view: memoryview, *, writable: bool = False) -> None:
        self._view = view
        self._pos = 0
        self._writable = writable

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return self._writable

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        end = len(self._view) if size is None or size < 0 else min(len(self._view), self._pos + size)
        data = bytes(self._view[self._pos:end])
        self._pos = max(self._pos, end)
        return data

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), len(self._view) - self._pos))
        memoryview(b).cast("B")[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n

    def write(self, b: Any) -> int:
        data = memoryview(b).cast("B")
        if self._pos + len(data) > len(self._view):
            raise CorruptCheckpointError(f"the blob is larger than the {len(self._view)} bytes asked for")
        self._view[self._pos:self._pos + len(data)] = data
        self._pos += len(data)
        return len(data)


def _block_body(views: Sequence[memoryview], starts: Sequence[int], start: int, end: int) -> memoryview | bytes:
    """Bytes ``[start, end)`` of the concatenated views: a slice, or one block-sized join."""
    pieces = []
    for view, base in zip(views, starts, strict=True):
        lo, hi = max(start, base), min(end, base + len(view))
        if lo < hi:
            pieces.append(view[lo - base:hi - base])
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


class _AzureLeaseStore:
    """The lease blob with ETag conditions: create-only, replace-if-unchanged, delete-if-unchanged."""

    compare_and_swap = True

    def __init__(self, backend: AzureBlobBackend) -> None:
        self._b = backend
        self._blob = backend._blob(_lease.LOCK_NAME)
        self._what = f"the writer lease {backend._show(_lease.LOCK_NAME)}"

    def load(self) -> _lease.LeaseObject | None:
        def get() -> _lease.LeaseObject | None:
            try:
                downloader = self._blob.download_blob()
                return _lease.LeaseObject(downloader.readall(), downloader.properties.etag)
            except ResourceNotFoundError:
                return None
        return self._b._call(f"read {self._what}", get)

    def _put(self, data: bytes, **conditions: Any) -> None:
        def put() -> None:
            try:
                self._blob.upload_blob(data, **conditions)
            except (ResourceExistsError, ResourceModifiedError) as e:
                raise _lease.LeaseLost from e
        self._b._call(f"write {self._what}", put)

    def create(self, data: bytes) -> None:
        self._put(data, overwrite=False)

    def replace(self, data: bytes, tag: str | None) -> None:
        self._put(data, overwrite=True, etag=tag, match_condition=MatchConditions.IfNotModified)

    def remove(self, tag: str | None) -> None:
        def delete() -> None:
            try:
                self._blob.delete_blob(etag=tag, match_condition=MatchConditions.IfNotModified)
            except (ResourceNotFoundError, ResourceModifiedError):
                pass
        self._b._call(f"delete {self._what}", delete)


class AzureBlobBackend:
    """Checkpoints under ``container/prefix`` of one Azure storage account."""

    def __init__(self, url: str, options: Mapping[str, Any] | None = None, *,
                 environ: Mapping[str, str] | None = None) -> None:
        self._options = dict(options or {})
        unknown = set(self._options) - set(_CREDENTIAL_OPTIONS) - set(_MPCKPT_OPTIONS)
        if unknown:
            raise ConfigError(f"{redact_url(url)}: unknown Azure storage options {sorted(unknown)}; "
                              f"known: {sorted(_CREDENTIAL_OPTIONS + _MPCKPT_OPTIONS)}")
        self._spec_root = url
        self._scheme = url.partition("://")[0].lower()
        self.url = redact_url(url).rstrip("/")
        self._container_name, _account, self._prefix = parse_url(url)
        self._create = bool(self._options.get("create", False))
        self._lease_s = _lease.parse_lease_s(self._options.get("lease_s", _lease.DEFAULT_LEASE_S))
        self._attempts = _positive_int(self._options, "retry_attempts", DEFAULT_ATTEMPTS)
        self._block_size = _positive_int(self._options, "block_size", DEFAULT_BLOCK_SIZE)
        self._concurrency = _positive_int(self._options, "max_concurrency", DEFAULT_CONCURRENCY)
        env = os.environ if environ is None else environ
        self._secrets = [str(v) for k, v in self._options.items() if k in _CREDENTIAL_OPTIONS and v]
        self._secrets += [env[k] for k in ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_KEY",
                                           "AZURE_STORAGE_SAS_TOKEN") if env.get(k)]
        try:
            service = service_client(url, self._options, env)
        except ValueError as e:  # a malformed connection string or account URL
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"{self.url}: bad Azure credentials option ({scrub(str(e), self._secrets)}); "
                              "check the connection string or account URL") from e
        self._container: ContainerClient = service.get_container_client(self._container_name)

    @classmethod
    def from_spec(cls, spec: BackendSpec) -> AzureBlobBackend:
        return cls(spec.root, spec.options)

    def spec(self) -> BackendSpec:
        return BackendSpec(self._scheme, self._spec_root, dict(self._options))

    def __repr__(self) -> str:
        return f"AzureBlobBackend({self.url!r})"

    # -- helpers --------------------------------------------------------------------------
    def _name(self, relpath: str) -> str:
        rel = check_relpath(relpath)
        return f"{self._prefix}/{rel}" if self._prefix else rel

    def _blob(self, relpath: str) -> Any:
        return self._container.get_blob_client(self._name(relpath))

    def _show(self, relpath: str) -> str:
        return f"{self.url}/{relpath}"

    def _translate(self, e: Exception, what: str) -> MpckptError:
        detail = scrub(f"{type(e).__name__}: {getattr(e, 'message', None) or e}", self._secrets)
        detail = detail.splitlines()[0] if detail else detail
        status = getattr(e, "status_code", None)
        if isinstance(e, ResourceNotFoundError):
            return CheckpointNotFoundError(f"{what}: it does not exist ({detail})")
        if isinstance(e, (ServiceRequestError, ServiceResponseError, ConnectionError, TimeoutError)) or (
                isinstance(e, HttpResponseError) and isinstance(status, int) and (status >= 500 or status in (408, 429))):
            return TransientStorageError(f"{what}: {detail}")
        if isinstance(e, ClientAuthenticationError) or status == 403:
            return StorageError(f"{what}: not authorised ({detail}); check the credentials and their permissions")
        return StorageError(f"{what}: {detail}")

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """Run one request with error translation and bounded retries."""
        def attempt() -> T:
            try:
                return fn()
            except (MpckptError, _lease.LeaseLost, *PROGRAMMING_ERRORS):
                raise
            except (AzureError, OSError) as e:
                raise self._translate(e, what) from e
        return retry(attempt, what=what, attempts=self._attempts)

    def _blob_names(self, relpath: str) -> list[str]:
        prefix = self._name(relpath) + "/"
        return self._call(f"list {self._show(relpath)}",
                          lambda: [b.name for b in self._container.list_blobs(name_starts_with=prefix)])

    def _delete_names(self, names: Sequence[str]) -> None:
        def delete(name: str) -> None:
            def one() -> None:
                try:
                    self._container.delete_blob(name)
                except ResourceNotFoundError:
                    pass
            self._call(f"delete {self.url}/{name}", one)
        with ThreadPoolExecutor(max_workers=max(1, min(self._concurrency, len(names)))) as pool:
            for future in [pool.submit(delete, n) for n in names]:
                future.result()

    # -- set-up --------------------------------------------------------------------------
    def check_writable(self) -> None:
        try:
            self._probe_or_create()
        except ConfigError:
            raise
        except (ClientAuthenticationError, HttpResponseError) as e:
            if isinstance(e, ClientAuthenticationError) or e.status_code in (401, 403):
                raise ConfigError(f"{self.url}: the credentials were refused ({self._translate(e, 'write')}); "
                                  "check the account key, SAS token or role assignment") from e
            raise ConfigError(f"{self.url} is not writable: {self._translate(e, 'write')}") from e
        except (AzureError, OSError) as e:
            raise ConfigError(f"{self.url}: cannot reach the storage account ({self._translate(e, 'connect')}); "
                              "check the account URL and the network") from e

    def _probe_or_create(self) -> None:
        """Write and delete a probe blob; create the container first if asked to and missing.

        Probing by a write (not by reading container properties) also works with a SAS token
        that may only write blobs.
        """
        probe = self._blob(f".mpckpt.probe.{secrets.token_hex(4)}")
        try:
            probe.upload_blob(b"mpckpt write probe", overwrite=True)
        except ResourceNotFoundError as e:
            if not self._create:
                raise ConfigError(
                    f"{self.url}: the container {self._container_name!r} does not exist; create it "
                    f"(`az storage container create --name {self._container_name}`) "
                    "or pass the storage option create=True") from e
            try:
                self._container.create_container()
            except ResourceExistsError:
                pass
            probe.upload_blob(b"mpckpt write probe", overwrite=True)
        probe.delete_blob()

    def acquire_writer_lock(self, owner: str) -> _lease.LeaseLock:
        lock = _lease.LeaseLock(_AzureLeaseStore(self), owner=owner, where=self.url, lease_s=self._lease_s)
        return lock.acquire()

    # -- writing ------------------------------------------------------------------------
    def stage(self, name: str) -> str:
        if self.exists(f"{name}/{MANIFEST_NAME}"):
            raise CommitConflictError(f"checkpoint {name} already exists in {self.url}; it is never overwritten")
        # One request only: stage runs inside save(). Leftovers of a failed attempt are removed
        # by abort() and, after a crash, by the recovery scan at the next open.
        return name

    def write_file(self, relpath: str, parts: Sequence[Buffer]) -> None:
        views = [memoryview(p).cast("B") for p in parts]
        total = sum(len(v) for v in views)
        blob = self._blob(relpath)
        what = f"upload {self._show(relpath)}"
        if total <= self._block_size:  # one request; at most one block-sized copy
            self._call(what, lambda: blob.upload_blob(b"".join(views), overwrite=True))
            return
        block_size = max(self._block_size, math.ceil(total / MAX_BLOCKS))
        count = math.ceil(total / block_size)
        ids = [f"{i:08d}" for i in range(count)]  # deterministic: a retry replaces, never duplicates
        starts = [0]
        for v in views[:-1]:
            starts.append(starts[-1] + len(v))

        def stage(i: int) -> None:
            start, end = i * block_size, min(total, (i + 1) * block_size)

            def put() -> None:
                body = _block_body(views, starts, start, end)
                data = _ViewStream(body) if isinstance(body, memoryview) else body
                blob.stage_block(ids[i], data, length=end - start)
            self._call(f"{what} (block {i + 1} of {count})", put)

        with ThreadPoolExecutor(max_workers=min(self._concurrency, count)) as pool:
            futures = [pool.submit(stage, i) for i in range(count)]
            done, pending = wait(futures, return_when=FIRST_EXCEPTION)
            for f in pending:
                f.cancel()
            for f in done:
                f.result()
        self._call(f"{what} (commit blocks)", lambda: blob.commit_block_list([BlobBlock(block_id=i) for i in ids]))

    def upload_file(self, relpath: str, local_path: str) -> None:
        if not os.path.isfile(local_path):
            raise CheckpointNotFoundError(f"cannot upload {local_path}: it does not exist")
        blob = self._blob(relpath)

        def put() -> None:
            with open(local_path, "rb") as f:
                blob.upload_blob(f, overwrite=True, max_concurrency=self._concurrency)
        self._call(f"upload {local_path} to {self._show(relpath)}", put)

    def commit(self, staging: str, name: str, manifest: bytes) -> None:
        if check_relpath(staging) != check_relpath(name):
            raise ConfigError(f"{self.url}: object stores stage in place; staging {staging!r} must equal {name!r}")
        blob = self._blob(f"{name}/{MANIFEST_NAME}")
        data = bytes(manifest)
        retried = False

        def put() -> None:
            nonlocal retried
            try:
                # INVARIANT: the manifest is written last, create-only (If-None-Match: *).
                blob.upload_blob(data, overwrite=False)
            except ResourceExistsError as e:
                if retried and self._read_quiet(blob) == data:
                    return  # our own earlier attempt landed before its reply was lost
                raise CommitConflictError(f"checkpoint {name} already exists in {self.url}; not replaced") from e
            except Exception:
                retried = True
                raise
        self._call(f"commit {self._show(name)}", put)

    @staticmethod
    def _read_quiet(blob: Any) -> bytes | None:
        try:
            return blob.download_blob().readall()
        except Exception:  # noqa: BLE001 - only used to recognise our own write
            return None

    def abort(self, staging: str) -> None:
        if self.exists(f"{staging}/{MANIFEST_NAME}"):
            return  # committed (by us or another writer): never removed by an abort
        self._delete_names(self._blob_names(staging))

    # -- reading ------------------------------------------------------------------------
    def list_names(self) -> list[str]:
        start = f"{self._prefix}/" if self._prefix else ""

        def walk() -> list[str]:
            items = self._container.walk_blobs(name_starts_with=start or None, delimiter="/")
            return sorted(i.name[len(start):].rstrip("/") for i in items if i.name.endswith("/"))
        try:
            return self._call(f"list {self.url}", walk)
        except CheckpointNotFoundError:
            return []

    def read_bytes(self, relpath: str, *, max_bytes: int | None = None) -> bytes:
        blob = self._blob(relpath)
        show = self._show(relpath)
        if max_bytes is None:
            return self._call(f"read {show}", lambda: blob.download_blob().readall())
        limit = max_bytes

        def get() -> bytes:
            try:  # one ranged request: never more than max_bytes + 1 bytes come back
                downloader = blob.download_blob(offset=0, length=limit + 1)
            except HttpResponseError as e:
                if e.status_code == 416:  # an empty blob has no byte 0 to start a range at
                    return b""
                raise
            if downloader.size > limit:
                total = str(downloader.properties.content_range or "").rpartition("/")[2]
                raise CorruptCheckpointError(
                    f"{show} is {total if total.isdigit() else f'more than {limit}'} bytes, above the {limit} "
                    "such a file may have; it is damaged or not written by mpckpt", path=show)
            return bytes(downloader.readall())
        return self._call(f"read {show}", get)

    def read_into(self, relpath: str, offset: int, out: memoryview) -> None:
        view = out.cast("B")
        if not view:
            return
        blob = self._blob(relpath)
        show = self._show(relpath)

        def get() -> int:
            try:
                downloader = blob.download_blob(offset=offset, length=len(view), max_concurrency=self._concurrency)
            except HttpResponseError as e:
                if e.status_code == 416:  # the range starts past the end
                    return 0
                raise
            return downloader.readinto(_ViewStream(view, writable=True))
        got = self._call(f"read {show} at {offset}", get)
        if got < len(view):
            raise CorruptCheckpointError(f"{show} is truncated: wanted bytes up to {offset + len(view)}, "
                                         f"file ends at {offset + got}", path=show)

    def size(self, relpath: str) -> int:
        blob = self._blob(relpath)
        return self._call(f"stat {self._show(relpath)}", lambda: int(blob.get_blob_properties().size))

    def exists(self, relpath: str) -> bool:
        blob = self._blob(relpath)
        return self._call(f"check {self._show(relpath)}", lambda: bool(blob.exists()))

    # -- housekeeping -------------------------------------------------------------------
    def delete(self, name: str) -> None:
        # INVARIANT: the manifest goes first, so the checkpoint stops existing at once.
        self._delete_names([self._name(f"{name}/{MANIFEST_NAME}")])
        self._delete_names(self._blob_names(name))

    def cleanup_incomplete(self) -> list[str]:
        return []  # staging is the final prefix; the ledger deletes manifest-less folders
