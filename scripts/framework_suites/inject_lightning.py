"""pytest plugin: every Lightning ``Trainer`` a test builds gets ``MpckptCheckpointIO``.

Loaded by ``scripts/framework_suite.py lightning`` with ``-p inject_lightning`` into Lightning's
own test run. It owns one patch, ``lightning.pytorch.Trainer.__init__``, which appends
``MpckptCheckpointIO()`` to ``plugins=``, and nothing else. A Trainer that already gets a
``CheckpointIO`` (in ``plugins=`` or its strategy's ``checkpoint_io``) keeps it: the test is
about that plugin, so it is not ours to replace. Each test records what happened as junit
properties (``mpckpt_injected``, ``mpckpt_kept_own``), which the runner counts.

``--mpckpt-root-outside``: every save of a test goes to one root in a temporary folder outside
the test's folders (``MpckptCheckpointIO(root=...)``), instead of the default root beside each
checkpoint folder (``<dirpath>.mpckpt``): a comparison with roots nowhere near the test's files.
"""

from __future__ import annotations

import functools
import shutil
import tempfile
from typing import Any

import pytest

_current: dict[str, Any] = {"item": None, "root": None}
_INJECTED = "mpckpt_injected"
_KEPT_OWN = "mpckpt_kept_own"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--mpckpt-root-outside", action="store_true",
                     help="one mpckpt root per test in a temporary folder, not <dirpath>.mpckpt")


def pytest_configure(config: pytest.Config) -> None:
    from lightning.fabric.plugins import CheckpointIO
    from lightning.pytorch import Trainer

    from mpckpt.integrations.lightning import MpckptCheckpointIO

    outside = bool(config.getoption("--mpckpt-root-outside"))
    original = Trainer.__init__

    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        plugins = kwargs.get("plugins")
        plugins = [] if plugins is None else list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
        strategy = kwargs.get("strategy")
        if any(isinstance(p, CheckpointIO) for p in plugins) or getattr(strategy, "_checkpoint_io", None) is not None:
            _count(_KEPT_OWN)
        else:
            root = _test_root() if outside else None
            kwargs["plugins"] = [*plugins, MpckptCheckpointIO(root=root)]
            _count(_INJECTED)
        original(self, *args, **kwargs)

    Trainer.__init__ = init  # type: ignore[method-assign]


def _test_root() -> str:
    if _current["root"] is None:
        _current["root"] = tempfile.mkdtemp(prefix="mpckpt-suite-root-")
    return str(_current["root"])


def _count(name: str) -> None:
    item = _current["item"]
    if item is None:
        return
    props = dict(item.user_properties)
    item.user_properties[:] = [(k, v) for k, v in item.user_properties if k != name]
    item.user_properties.append((name, int(props.get(name, 0)) + 1))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    _current["item"] = item
    try:
        return (yield)
    finally:
        _current["item"] = None
        root, _current["root"] = _current["root"], None
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)
