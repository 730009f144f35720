"""Shared fixtures: a clean MPCKPT_* environment for every test, small models, the servers; and
the expensive tiers as markers (``TIERS``): ``pytest -m "not nodes and not chaos"`` and the like."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from harness.servers import azurite_server, moto_server  # noqa: F401
from mpckpt._system import shm as _shm

# The expensive tiers, by test module: each launches what its name says for most of its tests.
TIERS: dict[str, tuple[str, ...]] = {
    "installs": ("test_install", "test_demo"),                       # fresh venvs and clones, pip
    "torchrun": ("test_distributed", "test_dcp_writer", "test_dcp_folders", "test_job_memory_kills",
                 "test_loop_state", "test_restarts", "test_transformers_dcp", "test_heal_in_job"),  # multi-process jobs
    "nodes": ("test_nodes", "test_peer_copies", "test_heal_nodes"),                     # simulated nodes (namespaces)
    "chaos": ("test_goodput",),                                      # the chaos run's short form
    "frameworks": ("test_lightning", "test_lightning_dcp", "test_lightning_files", "test_transformers",
                   "test_transformers_dcp", "test_transformers_folders", "test_ray", "test_export_hf"),
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        module = item.nodeid.split("::", 1)[0].rsplit("/", 1)[-1].removesuffix(".py")
        for marker, modules in TIERS.items():
            if module in modules:
                item.add_marker(marker)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("MPCKPT_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("MPCKPT_PROGRESS", "0")


@pytest.fixture(scope="session", autouse=True)
def _kept_snapshots_of_this_session_removed(tmp_path_factory: pytest.TempPathFactory) -> object:
    """Trainers the tests kill leave their snapshots kept in /dev/shm (as they should): those of
    this session's roots go at its end; anyone else's are never touched."""
    yield
    from mpckpt._keep import store

    base = str(tmp_path_factory.getbasetemp())
    for kept in store.list_kept():
        if kept.root is not None and base in kept.root and not kept.held:
            store.remove_kept(kept.base)


@pytest.fixture(autouse=True)
def _mpckpt_logger_as_found() -> object:
    """A command run in-process routes the library's log to itself (``cli._common``): every test
    starts with the ``mpckpt`` logger as it was, so caplog sees its records."""
    logger = logging.getLogger("mpckpt")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield
    logger.handlers[:] = saved[0]
    logger.setLevel(saved[1])  # (clears the logging module's cache of levels)
    logger.propagate = saved[2]


@pytest.fixture(autouse=True)
def _no_leaked_segments() -> object:
    """Every test must leave no shared-memory segment of this process behind."""
    before = set(_shm.segments_of_this_process())
    yield
    leaked = set(_shm.segments_of_this_process()) - before
    for name in leaked:  # clean up so one leak does not cascade into other tests
        try:
            os.unlink(os.path.join(_shm.SHM_DIR, name))
        except OSError:
            pass
    assert not leaked, f"shared-memory segments left behind: {sorted(leaked)}"


def make_model(width: int = 64, depth: int = 3, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 4))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> float:
    g = torch.Generator().manual_seed(seed)
    width = next(model.parameters()).shape[1]
    x = torch.randn(16, width, generator=g)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.detach())


def assert_same(a: object, b: object, path: str = "") -> None:
    """Bit-identical comparison of nested states (tensors by bytes, dtype and shape)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, (path, a.dtype, b.dtype, a.shape, b.shape)
        if a.numel():
            ua = a.detach().contiguous().view(-1).view(torch.uint8) if a.element_size() and a.dtype != torch.bool else a.contiguous().view(-1)
            ub = b.detach().contiguous().view(-1).view(torch.uint8) if b.element_size() and b.dtype != torch.bool else b.contiguous().view(-1)
            assert torch.equal(ua, ub), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (path, list(a), list(b) if isinstance(b, dict) else b)
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}.{i}")
    elif isinstance(a, float) and a != a:
        assert isinstance(b, float) and b != b, path
    else:
        assert a == b and type(a) is type(b), (path, a, b)
