"""Storage faults between the uploaders and a real object store (moto's S3, Azurite).

Every request of the checkpointer, its uploader processes and its committer goes through
``FaultProxy`` (``harness/fault_proxy.py``) in front of the real server: connection resets,
503 answers, responses cut short and stalled connections. Buckets and containers are created
and results are checked at the real server's own port, past the proxy.

What must hold: transient faults are retried and the saves commit and restore bit-identical;
a fault that does not go away fails the save with ``UploadError`` naming the step, in bounded
time, leaving no manifest behind and every earlier checkpoint intact; a stalled connection ends
in the client's read timeout, never a hang; after the fault clears the next save succeeds.
Waits are bounded by ``future.result(timeout)``, which raises rather than hang.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import pytest
import torch

import mpckpt
from harness.fault_proxy import FaultProxy
from harness.servers import s3_options
from mpckpt import _testing
from mpckpt.errors import MpckptError, UploadError
from mpckpt.format.manifest import checkpoint_name
from tests.conftest import assert_same
from tests.states import random_state

BACKENDS = [pytest.param("s3", marks=pytest.mark.s3), pytest.param("azure", marks=pytest.mark.azure)]
READ_TIMEOUT_S = 2  # client socket timeouts, small so that a stall ends quickly
RETRY_ATTEMPTS = 4  # mpckpt's own retries per storage operation
BOUND_S = 90  # no save in this file may take longer than this to finish, one way or the other


def _is_put(method: str, path: str) -> bool:
    return method == "PUT" and ".mpckpt.lock" not in path  # writes of data and manifests, not the lease


@dataclass
class Store:
    """One fresh bucket/container, reachable through the proxy and directly."""

    backend: str
    url: str
    options: dict[str, Any]   # through the proxy
    direct: dict[str, Any]    # straight to the server
    proxy: FaultProxy
    container: Any = None     # Azure ContainerClient (direct)
    fs: Any = None            # s3fs filesystem (direct)
    bucket: str = ""

    def with_options(self, **extra: Any) -> dict[str, Any]:
        return {**self.options, **extra}

    def manifest_exists(self, step: int) -> bool:
        key = f"run/{checkpoint_name(step)}/manifest.json"
        if self.backend == "s3":
            self.fs.invalidate_cache()
            return bool(self.fs.exists(f"{self.bucket}/{key}"))
        return bool(self.container.get_blob_client(key).exists())


@pytest.fixture(params=BACKENDS)
def store(request: pytest.FixtureRequest) -> Iterator[Store]:
    name = f"mpckpt-{uuid.uuid4().hex[:16]}"
    if request.param == "s3":
        import s3fs

        endpoint = request.getfixturevalue("moto_server")
        fs = s3fs.S3FileSystem(**s3_options(endpoint), skip_instance_cache=True)
        fs.mkdir(name)
        with FaultProxy(urlparse(endpoint).port, seed=7) as proxy:
            options = s3_options(f"http://127.0.0.1:{proxy.port}", retry_attempts=RETRY_ATTEMPTS, config_kwargs={
                "read_timeout": READ_TIMEOUT_S, "connect_timeout": READ_TIMEOUT_S,
                "retries": {"mode": "standard", "max_attempts": 2}})
            yield Store("s3", f"s3://{name}/run", options, s3_options(endpoint), proxy, fs=fs, bucket=name)
    else:
        from azure.storage.blob import BlobServiceClient

        conn = request.getfixturevalue("azurite_server")
        port = int(conn.split("BlobEndpoint=")[1].split(":")[2].split("/")[0])
        container = BlobServiceClient.from_connection_string(conn).create_container(name)
        with FaultProxy(port, seed=7) as proxy:
            proxied = conn.replace(f"127.0.0.1:{port}/", f"127.0.0.1:{proxy.port}/")
            options = {"connection_string": proxied, "retry_attempts": RETRY_ATTEMPTS,
                       "client_kwargs": {"read_timeout": READ_TIMEOUT_S, "connection_timeout": READ_TIMEOUT_S}}
            yield Store("azure", f"az://{name}/run", options, {"connection_string": conn}, proxy, container=container)


def _state(step: int, *, tensors: int = 4, numel: int = 64 * 1024) -> dict[str, Any]:
    return random_state(step, {**{f"w{i}": (numel,) for i in range(tensors)}, "ints": (1000,)},
                        dtypes={"ints": torch.int64}, step=step)


def _result(future: mpckpt.SaveFuture | Any) -> Any:
    return future.result(BOUND_S)  # raises WaitTimeoutError rather than hang


def test_transient_faults_are_retried_and_saves_restore_bit_identical(store: Store) -> None:
    proxy = store.proxy
    with mpckpt.Checkpointer(store.url, storage_options=store.options, workers=2, timeout_s=BOUND_S) as ckpt:
        ckpt.save(0, _state(0), mode="sync")
        # A scripted mix with passes in between, so that no one request fails every attempt,
        # then a seeded random sprinkle of the same faults over everything that follows.
        proxy.sequence(["reset", "pass", "http_503", "pass", "truncate", "pass", "pass",
                        "reset", "pass", "http_503", "pass", "truncate"])
        for kind in ("reset", "http_503", "truncate"):
            proxy.inject(kind, times=None, probability=0.03, seed=len(kind))
        futures = [ckpt.save(step, _state(step)) for step in (1, 2, 3)]
        results = [_result(f) for f in futures]
        proxy.clear()
        assert [r.name for r in results] == [checkpoint_name(s) for s in (1, 2, 3)]
        assert ckpt.steps() == [0, 1, 2, 3]
        assert all(not slab.in_use for slab in _testing.slabs(ckpt))
    for kind in ("reset", "http_503", "truncate"):
        assert proxy.injected[kind] >= 1, (kind, proxy.injected)
    for step in (0, 1, 2, 3):  # read past the proxy: what is stored is what was saved
        assert_same(_state(step), mpckpt.load(store.url, step=step, storage_options=store.direct))
    print(f"\n[{store.backend}] transient: {proxy.requests} requests, injected {dict(proxy.injected)}")


def test_lost_reply_to_the_manifest_write_still_commits(store: Store) -> None:
    """The manifest PUT lands but its reply is cut: the retry must recognise its own manifest."""
    proxy = store.proxy
    with mpckpt.Checkpointer(store.url, storage_options=store.options, workers=1, timeout_s=BOUND_S) as ckpt:
        proxy.inject("truncate", times=1, match=lambda m, p: m == "PUT" and p.split("?")[0].endswith("manifest.json"))
        result = _result(ckpt.save(5, _state(5)))
        assert result.name == checkpoint_name(5)
        assert ckpt.steps() == [5]
    assert proxy.injected["truncate"] == 1
    assert_same(_state(5), mpckpt.load(store.url, storage_options=store.direct))


@pytest.mark.parametrize("kind", ["reset", "http_503"])
def test_persistent_fault_fails_the_save_cleanly_and_the_next_save_succeeds(store: Store, kind: str) -> None:
    proxy = store.proxy
    with mpckpt.Checkpointer(store.url, storage_options=store.options, workers=2, timeout_s=BOUND_S) as ckpt:
        ckpt.save(1, _state(1), mode="sync")
        proxy.inject(kind, times=None, match=_is_put)  # every data and manifest write fails
        started = time.monotonic()
        future = ckpt.save(2, _state(2))
        with pytest.raises(UploadError) as info:
            _result(future)  # bounded: a hang would raise WaitTimeoutError, not UploadError
        elapsed = time.monotonic() - started
        proxy.clear()
        assert info.value.step == 2
        assert "step 2" in str(info.value)
        assert ckpt.steps() == [1]
        assert not store.manifest_exists(2)
        assert all(not slab.in_use for slab in _testing.slabs(ckpt))
        ckpt.wait()  # the failure was seen on the future: not raised a second time
        assert _result(ckpt.save(3, _state(3))).name == checkpoint_name(3)
        assert ckpt.steps() == [1, 3]
    assert proxy.injected[kind] >= RETRY_ATTEMPTS
    assert_same(_state(1), mpckpt.load(store.url, step=1, storage_options=store.direct))
    assert_same(_state(3), mpckpt.load(store.url, step=3, storage_options=store.direct))
    with pytest.raises(mpckpt.errors.CheckpointNotFoundError):
        mpckpt.load(store.url, step=2, storage_options=store.direct)
    print(f"\n[{store.backend}] persistent {kind}: failed after {elapsed:.1f}s, {proxy.requests} requests, "
          f"injected {dict(proxy.injected)}; error: {info.value}")


def test_stall_longer_than_the_read_timeout_is_retried(store: Store) -> None:
    proxy = store.proxy
    proxy.stall_s = 10 * BOUND_S  # never lets go within the test: only the client's timeout can end it
    try:
        with mpckpt.Checkpointer(store.url, storage_options=store.options, workers=2, timeout_s=BOUND_S) as ckpt:
            assert _result(ckpt.save(0, _state(0))).name == checkpoint_name(0)
            # reads and listings (writes: see the next test); a save itself reads nothing
            proxy.inject("stall", times=2, match=lambda m, p: m != "PUT" and ".mpckpt.lock" not in p)
            started = time.monotonic()
            loaded = mpckpt.load(store.url, storage_options=store.options)  # loading at all means the client gave up
            elapsed = time.monotonic() - started
    finally:
        proxy.release_stalls()
    assert proxy.injected["stall"] == 2
    assert_same(_state(0), loaded)
    assert_same(_state(0), mpckpt.load(store.url, storage_options=store.direct))
    print(f"\n[{store.backend}] transient stall: loaded after {elapsed:.1f}s, injected {dict(proxy.injected)}")


def test_stalled_writes_end_in_a_read_timeout(store: Store, request: pytest.FixtureRequest) -> None:
    proxy = store.proxy
    proxy.stall_s = 120.0  # far longer than any bound below: only the client's timeout can end it
    opts = store.with_options(retry_attempts=1)
    # the clients' own timeouts end most stalls; the per-file deadline ends the rest (S3 PUTs
    # wait for "100 Continue" without a timeout): the hung uploader is killed and the job retried
    with mpckpt.Checkpointer(store.url, storage_options=opts, workers=1, timeout_s=BOUND_S, job_timeout_s=5) as ckpt:
        ckpt.save(0, _state(0), mode="sync")
        proxy.inject("stall", times=None, match=_is_put)
        started = time.monotonic()
        try:
            with pytest.raises(UploadError) as info:
                ckpt.save(1, _state(1)).result(30)
        finally:
            elapsed = time.monotonic() - started
            proxy.clear()
            proxy.release_stalls()  # so that a hung write ends and the checkpointer can close
            try:
                ckpt.wait(timeout_s=BOUND_S)
            except MpckptError:
                pass
        assert info.value.step == 1
        assert ckpt.steps() == [0]
        assert not store.manifest_exists(1)
    assert_same(_state(0), mpckpt.load(store.url, storage_options=store.direct))
    print(f"\n[{store.backend}] persistent stall: failed after {elapsed:.1f}s, injected {dict(proxy.injected)}")


def test_outage_during_a_save_does_not_wedge_later_saves(store: Store) -> None:
    """An outage while a save is in flight fails that save, once, and the checkpointer stays usable.

    ``save`` makes no storage request on the training thread: the outage reaches the caller
    through the save's future (and would at the next save or wait if nobody looked)."""
    proxy = store.proxy
    # (timeout_s bounds the sync save, the uploaders' start on a loaded machine included: not 5 s)
    with mpckpt.Checkpointer(store.url, storage_options=store.with_options(retry_attempts=1), workers=1,
                             timeout_s=BOUND_S) as ckpt:
        ckpt.save(0, _state(0), mode="sync")
        proxy.inject("http_503", times=None, match=lambda m, p: ".mpckpt.lock" not in p)
        failed = ckpt.save(1, _state(1))
        with pytest.raises(MpckptError, match="step 1"):
            failed.result(BOUND_S)
        proxy.clear()
        assert ckpt.save(2, _state(2)).result(10).name == checkpoint_name(2)
        ckpt.wait(timeout_s=10)  # the failure was raised by save(1): not raised a second time
        assert ckpt.steps() == [0, 2]


def test_an_outage_as_the_checkpointer_opens_is_retried_not_a_config_error(store: Store) -> None:
    """A job relaunched while storage is briefly out opens once it is back: the open's write probe
    retries transient errors as every write does, rather than calling the root "not writable" at the
    first reset (``bench/goodput.py`` found it: a rank killed during an S3 outage, the relaunched job
    failed at once with ``ConfigError``). The resets outlast the client's own attempts for one call (S3:
    s3fs's 5 times botocore's 2; the Azure client makes one) and not mpckpt's ``RETRY_ATTEMPTS`` of them."""
    resets = 12 if store.backend == "s3" else RETRY_ATTEMPTS - 1
    store.proxy.inject("reset", times=resets, match=lambda method, path: ".mpckpt.probe." in path)
    with mpckpt.Checkpointer(store.url, storage_options=store.options, workers=1, timeout_s=BOUND_S) as ckpt:
        _result(ckpt.save(0, _state(0, tensors=1, numel=256), mode="sync"))
    assert store.proxy.injected["reset"] == resets
    assert store.manifest_exists(0)
