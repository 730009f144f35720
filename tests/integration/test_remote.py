"""The Checkpointer contract against real object stores: S3 (moto's server) and Azure Blob (Azurite).

Every test runs once per backend; the ``remote`` fixture yields ``(url, storage_options)`` for a
bucket or container of its own that does not exist yet (``create=True`` makes it). The servers
are the session fixtures of ``harness/servers.py``; a test is skipped only when a server program
is not installed.
"""

from __future__ import annotations

import contextlib
import os
import traceback
import urllib.request
import uuid
from collections.abc import Iterator

import pytest
import torch

import mpckpt
from harness.servers import AZURITE_KEY, s3_options
from mpckpt.errors import ConfigError
from tests.conftest import assert_same, make_model, train_step

BACKENDS = [pytest.param("s3", marks=pytest.mark.s3), pytest.param("azure", marks=pytest.mark.azure)]
WRONG_SECRET = "Zm9yZ2VkLXNlY3JldC1mb3ItbXBja3B0LXRlc3Rz"  # base64, so Azure's client accepts its shape


def _name() -> str:
    return f"mpckpt-{uuid.uuid4().hex[:16]}"


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def server(backend: str, request: pytest.FixtureRequest) -> str:
    """The running server of ``backend``: moto's endpoint URL or Azurite's connection string."""
    return request.getfixturevalue("moto_server" if backend == "s3" else "azurite_server")


def _url_and_options(backend: str, server: str, bucket: str, **extra: object) -> tuple[str, dict]:
    if backend == "s3":
        return f"s3://{bucket}/run", s3_options(server, **extra)
    return f"az://{bucket}/run", {"connection_string": server, **extra}


@pytest.fixture
def remote(backend: str, server: str) -> Iterator[tuple[str, dict]]:
    """``(url, storage_options)`` of a fresh bucket / container, created on first open."""
    yield _url_and_options(backend, server, _name(), create=True)


def test_async_saves_restore_bit_identical(remote):
    url, opts = remote
    model, opt = make_model()
    state = {"model": model, "optim": opt, "epoch": 0}
    snapshots = {}
    with mpckpt.Checkpointer(url, storage_options=opts, workers=2) as ckpt:
        assert ckpt.restore(state) is None
        for step in (1, 2, 5):
            train_step(model, opt, step)
            state["epoch"] = step
            ckpt.save(step, state)  # ASYNC is the default
            snapshots[step] = {"model": {k: v.clone() for k, v in model.state_dict().items()}}
        ckpt.wait()
    loaded = mpckpt.load(url, step=2, storage_options=opts)
    assert_same(snapshots[2]["model"], loaded["model"])
    assert loaded["epoch"] == 2

    model2, opt2 = make_model(seed=1)
    state2 = {"model": model2, "optim": opt2, "epoch": -1}
    with mpckpt.Checkpointer(url, storage_options=opts, workers=1) as again:
        assert again.restore(state2) == 5
    assert state2["epoch"] == 5
    assert_same(model.state_dict(), model2.state_dict())
    assert_same(opt.state_dict(), opt2.state_dict())


def test_commit_order_and_reopen_sees_the_same_steps(remote):
    url, opts = remote
    steps = [3, 7, 8, 20, 21]
    with mpckpt.Checkpointer(url, storage_options=opts, workers=2) as ckpt:
        futures = [ckpt.save(s, {"x": torch.full((1000,), float(s)), "step": s}) for s in steps]
        results = [f.result(60) for f in futures]
        assert [r.name for r in results] == [f"step_{s:010d}" for s in steps]
        assert ckpt.steps() == steps
        assert ckpt.latest_step == 21
    with mpckpt.Checkpointer(url, storage_options=opts, workers=1) as again:
        assert again.steps() == steps
        assert again.latest_step == 21
        loaded = again.load()
    assert loaded["step"] == 21 and torch.equal(loaded["x"], torch.full((1000,), 21.0))


def test_directory_checkpoints_via_report(remote, tmp_path):
    url, opts = remote
    src = tmp_path / "hf"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text('{"a": 1}')
    payload = os.urandom(3000)
    (src / "sub" / "weights.bin").write_bytes(payload)
    with mpckpt.Checkpointer(url, storage_options=opts, workers=2) as ckpt:
        fut = ckpt.report({"loss": 0.5}, checkpoint=mpckpt.Checkpoint.from_directory(src), step=10)
        fut.result(60)
        assert ckpt.steps() == [10]
        stored = ckpt.checkpoint(10)
        assert stored.files() == ["config.json", "sub/weights.bin"]
        out = stored.to_directory(tmp_path / "out")
        with stored.as_directory() as d:
            assert open(os.path.join(d, "config.json")).read() == '{"a": 1}'
    assert open(os.path.join(out, "config.json")).read() == '{"a": 1}'
    assert open(os.path.join(out, "sub", "weights.bin"), "rb").read() == payload
    assert not src.exists()  # ASYNC: the local folder is deleted after upload


def test_keep_last_lists_and_deletes(remote):
    url, opts = remote
    with mpckpt.Checkpointer(url, storage_options=opts, workers=1, keep_last=2) as ckpt:
        for step in range(5):
            ckpt.save(step, {"x": torch.ones(4) * step}, mode="sync")
        assert ckpt.steps() == [3, 4]
    with mpckpt.Checkpointer(url, storage_options=opts, workers=1) as again:
        assert again.steps() == [3, 4]
    with pytest.raises(mpckpt.errors.CheckpointNotFoundError):
        mpckpt.load(url, step=1, storage_options=opts)
    assert torch.equal(mpckpt.load(url, step=3, storage_options=opts)["x"], torch.ones(4) * 3)


def test_a_few_mib_across_two_workers_makes_several_shards(remote):
    url, opts = remote
    g = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(256 * 1024, generator=g) for i in range(6)}  # 6 MiB in six tensors
    state["ints"] = torch.randint(0, 1 << 30, (100_000,), generator=g)
    with mpckpt.Checkpointer(url, storage_options=opts, workers=2) as ckpt:
        ckpt.save(0, state)
        ckpt.wait()
        files = ckpt.checkpoint(0).files()
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) >= 2, files
    assert_same(state, mpckpt.load(url, storage_options=opts))


def test_missing_bucket_without_create_is_a_config_error(backend, server):
    url, opts = _url_and_options(backend, server, _name())
    with pytest.raises(ConfigError) as info:
        mpckpt.Checkpointer(url, storage_options=opts, workers=1)
    assert url in str(info.value)
    assert "create=True" in str(info.value)


def _all_text(e: BaseException) -> str:
    """The message, notes and causes of ``e``: everything a user could be shown."""
    return "".join(traceback.format_exception(e))


def test_wrong_credentials_are_a_config_error_without_the_secret(backend, server, remote):
    url, good = remote
    with mpckpt.Checkpointer(url, storage_options=good, workers=1) as ckpt:  # the container exists
        ckpt.save(0, {"x": torch.ones(2)}, mode="sync")
    if backend == "s3":
        bad = s3_options(server, secret=WRONG_SECRET)
        bad["key"] = "AKIAWRONGKEY00000000"
        auth: contextlib.AbstractContextManager = _MotoAuth(server)
    else:
        bad = {"connection_string": server.replace(AZURITE_KEY, WRONG_SECRET)}
        auth = contextlib.nullcontext()
    with auth, pytest.raises(ConfigError) as info:
        mpckpt.Checkpointer(url, storage_options=bad, workers=1)
    message = str(info.value)
    assert url in message
    assert "credential" in message.lower() or "permission" in message.lower()
    assert WRONG_SECRET not in message
    assert WRONG_SECRET not in _all_text(info.value)


class _MotoAuth:
    """Turn on moto's IAM checks for a block (off by default, so any key works), then off again."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint

    def _set(self, count: str) -> None:
        req = urllib.request.Request(f"{self.endpoint}/moto-api/reset-auth", data=count.encode(), method="POST",
                                     headers={"Content-Type": "text/plain"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            resp.read()

    def __enter__(self) -> None:
        self._set("0")

    def __exit__(self, *exc: object) -> None:
        self._set("inf")
