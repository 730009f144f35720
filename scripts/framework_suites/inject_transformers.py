"""pytest plugin: every Hugging Face ``Trainer`` a test builds saves through ``MpckptCallback``.

Loaded by ``scripts/framework_suite.py transformers`` with ``-p inject_transformers`` into the
transformers test run. It owns two patches and nothing else:

* ``Trainer.__init__`` adds ``MpckptCallback()`` (last in the callback list), with its default
  root (``<output_dir>.mpckpt``, beside the folder) and its ``checkpoint-N`` folders: the
  default settings, as a user writes the one line. With ``--mpckpt-root-outside`` the root is a
  temporary folder per ``output_dir`` (the same one for every Trainer of the test on that
  folder), removed after the test. ``--mpckpt-discard-newer`` gives the callback
  ``discard_newer=True`` (the Trainer's own saves overwrite newer checkpoints).
* With ``--mpckpt-resume-path`` (the integration before its folders, ``trainer_folders=False``),
  ``Trainer.train(resume_from_checkpoint=...)`` goes through ``resume_path``: ``True`` becomes
  ``resume_path(root)`` (the newest committed step), a path ``<dir>/checkpoint-N`` becomes
  ``resume_path(root of <dir>, step=N)``; when the root has no such checkpoint the argument is
  passed on unchanged, so the Trainer raises its own error. Without it the Trainer resumes from
  the folders itself, unchanged.

Each test records what happened as junit properties (``mpckpt_injected``, ``mpckpt_resumes``),
which the runner counts.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import tempfile
from typing import Any

import pytest

_current: dict[str, Any] = {"item": None, "roots": {}}
_CHECKPOINT_DIR = re.compile(r"checkpoint-(\d+)$")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--mpckpt-root-outside", action="store_true",
                     help="mpckpt roots in temporary folders, not the default <output_dir>.mpckpt")
    parser.addoption("--mpckpt-resume-path", action="store_true",
                     help="trainer_folders=False, resumes through resume_path (the integration before its folders)")
    parser.addoption("--mpckpt-discard-newer", action="store_true", help="MpckptCallback(root, discard_newer=True)")


def pytest_configure(config: pytest.Config) -> None:
    from transformers import Trainer

    from mpckpt.errors import CheckpointNotFoundError
    from mpckpt.integrations.transformers import MpckptCallback, default_root, resume_path

    outside = bool(config.getoption("--mpckpt-root-outside"))
    options: dict[str, Any] = {"discard_newer": True} if config.getoption("--mpckpt-discard-newer") else {}
    routing = bool(config.getoption("--mpckpt-resume-path"))
    if routing:
        options["trainer_folders"] = False
    original_init, original_train = Trainer.__init__, Trainer.train

    def root_of(output_dir: str) -> str:
        key = os.path.abspath(output_dir)
        if not outside:
            return default_root(key)
        roots = _current["roots"]
        if key not in roots:
            roots[key] = tempfile.mkdtemp(prefix="mpckpt-suite-root-")
        return str(roots[key])

    @functools.wraps(original_init)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        if self.args.output_dir is not None:
            self.add_callback(MpckptCallback(root_of(self.args.output_dir) if outside or routing else None, **options))
            _count("mpckpt_injected")

    @functools.wraps(original_train)
    def train(self: Any, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        routed = None
        if not routing:
            return original_train(self, resume_from_checkpoint, *args, **kwargs)
        try:
            if resume_from_checkpoint is True and self.args.output_dir is not None:
                routed = resume_path(root_of(self.args.output_dir))
            elif isinstance(resume_from_checkpoint, (str, os.PathLike)):
                path = os.fspath(resume_from_checkpoint).rstrip("/")
                match = _CHECKPOINT_DIR.search(os.path.basename(path))
                root = root_of(os.path.dirname(path) or ".")
                if match and os.path.isdir(root):
                    routed = resume_path(root, int(match.group(1)))
        except CheckpointNotFoundError:
            routed = None  # not saved by mpckpt: the Trainer's own handling of the argument
        if routed is not None:
            resume_from_checkpoint = routed
            _count("mpckpt_resumes")
        return original_train(self, resume_from_checkpoint, *args, **kwargs)

    Trainer.__init__ = init  # type: ignore[method-assign]
    Trainer.train = train  # type: ignore[method-assign]


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
        roots, _current["roots"] = _current["roots"], {}
        for root in roots.values():
            shutil.rmtree(root, ignore_errors=True)
