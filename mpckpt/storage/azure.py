"""Checkpoints in Azure Blob Storage, natively on ``azure-storage-blob`` (``mpckpt[azure]``).

URLs: ``az://container/prefix``, ``abfs[s]://container@account.dfs.core.windows.net/prefix``
and ``abfs://container/prefix``. Credentials come from the storage options
(``connection_string``; or ``account_url``/``account_name`` with ``account_key``,
``sas_token`` or ``credential``), else from ``AZURE_STORAGE_CONNECTION_STRING`` /
``AZURE_STORAGE_ACCOUNT_NAME`` + ``AZURE_STORAGE_ACCOUNT_KEY`` or ``AZURE_STORAGE_SAS_TOKEN``,
else from ``azure.identity.DefaultAzureCredential`` when that package is installed. They never
appear in ``url``, reprs or messages.

The manifest-last commit protocol and its invariants live in ``object_store.py``; this module
supplies the Azure primitives. Shards are uploaded as blocks straight from shared memory
(memoryview slices, never one copy of the shard) in parallel under deterministic block ids, so
a retried block replaces its earlier attempt; ``commit_block_list`` publishes each shard. The
manifest's create-only put is ``If-None-Match: *``, which Azure evaluates atomically.

The writer lock is the JSON lease of ``_lease.py`` kept with ETag conditions (atomic
compare-and-swap). The SDK's own retries are off so there is exactly one retry policy (the
base's ``_call``).
"""

from __future__ import annotations

import functools
import io
import math
import os
import secrets
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, wait
from typing import Any

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

from mpckpt._threads import executor
from mpckpt.errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    MpckptError,
    StorageError,
    TransientStorageError,
)
from mpckpt.storage import _lease
from mpckpt.storage._redact import redact_url, scrub
from mpckpt.storage._retry import retry
from mpckpt.storage.base import Buffer, check_relpath
from mpckpt.storage.object_store import MPCKPT_OPTIONS, ObjectStoreBackend, positive_int

DEFAULT_BLOCK_SIZE = 8 << 20
DEFAULT_CONCURRENCY = 8
MAX_BLOCKS = 50_000  # Azure's limit of blocks per blob
_CREDENTIAL_OPTIONS = ("connection_string", "account_url", "account_name", "account_key", "sas_token", "credential")


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


class AzureBlobBackend(ObjectStoreBackend):
    """Checkpoints under ``container/prefix`` of one Azure storage account."""

    own_options = (*MPCKPT_OPTIONS, "block_size", "max_concurrency", "client_kwargs")
    client_errors = (AzureError, OSError)
    exists_errors = (ResourceExistsError,)

    def __init__(self, url: str, options: Mapping[str, Any] | None = None, *,
                 environ: Mapping[str, str] | None = None) -> None:
        unknown = set(options or {}) - set(_CREDENTIAL_OPTIONS) - set(self.own_options)
        if unknown:
            raise ConfigError(f"{redact_url(url)}: unknown Azure storage options {sorted(unknown)}; "
                              f"known: {sorted(_CREDENTIAL_OPTIONS + self.own_options)}")
        self._container_name, _account, prefix = parse_url(url)
        super().__init__(url, options)
        self._root = prefix
        self._block_size = positive_int(self._options, "block_size", DEFAULT_BLOCK_SIZE)
        self._concurrency = positive_int(self._options, "max_concurrency", DEFAULT_CONCURRENCY)
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

    # -- primitives (the protocol itself is ObjectStoreBackend's) ------------------------
    def _blob(self, relpath: str) -> Any:
        return self._container.get_blob_client(self._key(relpath))

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

    def _create_object(self, relpath: str, data: bytes) -> None:
        # only commit calls this, for the manifest (INVARIANT: manifest is written last)
        self._blob(relpath).upload_blob(data, overwrite=False)  # If-None-Match: *

    def _get_object(self, relpath: str) -> bytes:
        return bytes(self._blob(relpath).download_blob().readall())

    def _delete_blob_quiet(self, name: str) -> None:
        try:
            self._container.delete_blob(name)
        except ResourceNotFoundError:
            pass

    def _delete_object(self, relpath: str) -> None:
        self._delete_blob_quiet(self._key(relpath))

    def _delete_prefix(self, relpath: str, what: str) -> None:
        # blob by blob, in parallel, each retried (and named in errors) on its own
        self._delete_names(self._blob_names(relpath))

    def _copy_prefix(self, relpath: str, to: str) -> None:
        source, target = self._key(relpath), self._key(to)
        for name in self._blob_names(relpath):
            dest = self._container.get_blob_client(target + name[len(source):])
            url = self._container.get_blob_client(name).url
            self._call(f"copy {self._show(relpath)} to {self._show(to)}", functools.partial(_copy_blob, dest, url))

    def _upload(self, relpath: str, local_path: str) -> None:
        blob = self._blob(relpath)

        def put() -> None:
            with open(local_path, "rb") as f:
                blob.upload_blob(f, overwrite=True, max_concurrency=self._concurrency)
        self._call(f"upload {local_path} to {self._show(relpath)}", put)

    def _lease_store(self) -> _AzureLeaseStore:
        return _AzureLeaseStore(self)

    def _blob_names(self, relpath: str) -> list[str]:
        prefix = self._key(relpath) + "/"
        return self._call(f"list {self._show(relpath)}",
                          lambda: [b.name for b in self._container.list_blobs(name_starts_with=prefix)])

    def _delete_names(self, names: Sequence[str]) -> None:
        def delete(name: str) -> None:
            self._call(f"delete {self.url}/{name}", lambda: self._delete_blob_quiet(name))
        with executor(max(1, min(self._concurrency, len(names))), "mpckpt-azure") as pool:
            for future in [pool.submit(delete, n) for n in names]:
                future.result()

    # -- set-up --------------------------------------------------------------------------
    def check_writable(self) -> None:
        def attempt() -> None:
            try:
                self._probe_or_create()
            except (AzureError, OSError) as e:
                translated = self._translate(e, "write a probe")
                if isinstance(translated, TransientStorageError):  # an outage as a job restarts: retried, as
                    raise translated from e                         # every write is, not a wrong account URL
                raise

        try:
            retry(attempt, what=f"write a probe to {self.url}", attempts=self._attempts)
        except ConfigError:
            raise
        except TransientStorageError as e:
            detail = e.__cause__ if isinstance(e.__cause__, TransientStorageError) else e
            raise ConfigError(f"{self.url}: cannot reach the storage account ({detail}); "
                              "check the account URL and the network") from e
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

    # -- writing ------------------------------------------------------------------------
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

        with executor(min(self._concurrency, count), "mpckpt-azure") as pool:
            futures = [pool.submit(stage, i) for i in range(count)]
            done, pending = wait(futures, return_when=FIRST_EXCEPTION)
            for f in pending:
                f.cancel()
            for f in done:
                f.result()
        self._call(f"{what} (commit blocks)", lambda: blob.commit_block_list([BlobBlock(block_id=i) for i in ids]))

    # -- reading ------------------------------------------------------------------------
    def list_names(self) -> list[str]:
        start = f"{self._root}/" if self._root else ""

        def walk() -> list[str]:
            items = self._container.walk_blobs(name_starts_with=start or None, delimiter="/")
            return sorted(i.name[len(start):].rstrip("/") for i in items if i.name.endswith("/"))
        try:
            return self._call(f"list {self.url}", walk)
        except CheckpointNotFoundError:
            return []

    def list_files(self, folder: str) -> list[str]:
        rel = check_relpath(folder)
        start = self._key(rel) + "/"

        def walk() -> list[str]:
            items = self._container.walk_blobs(name_starts_with=start, delimiter="/")
            return sorted(f"{rel}/{i.name[len(start):]}" for i in items if not i.name.endswith("/"))
        try:
            return self._call(f"list {self._show(rel)}", walk)
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
                raise self._too_big(relpath, f"{total if total.isdigit() else f'more than {limit}'} bytes", limit)
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
            raise self._truncated(relpath, offset + len(view), offset + got)

    def size(self, relpath: str) -> int:
        blob = self._blob(relpath)
        return self._call(f"stat {self._show(relpath)}", lambda: int(blob.get_blob_properties().size))

    def exists(self, relpath: str) -> bool:
        blob = self._blob(relpath)
        return self._call(f"check {self._show(relpath)}", lambda: bool(blob.exists()))


def _copy_blob(dest: Any, source_url: str, *, timeout_s: float = 600.0) -> None:
    """A server-side copy within the account; waits (bounded) until the service has finished it."""
    props = dest.start_copy_from_url(source_url)
    status = props.get("copy_status")
    deadline = time.monotonic() + timeout_s
    while status == "pending":
        if time.monotonic() > deadline:
            dest.abort_copy(props["copy_id"])
            raise TimeoutError(f"copying {source_url} did not finish within {timeout_s:.0f} s")
        time.sleep(0.2)
        status = dest.get_blob_properties().copy.status
    if status != "success":
        raise OSError(f"copying {source_url} ended with status {status}")
