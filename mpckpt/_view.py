"""Reading what a root has committed: ``ReadsCommitted`` (the queries and reads a writer's
``Runtime`` and a read-only view share), ``StorageView`` (what a read-only Checkpointer holds)
and ``mpckpt.load``.

Neither holds a lock, uploaders, shared memory or a recovery scan: a writer elsewhere may own
the root, so the root is listed anew for every question, checkpoints whose manifest does not
verify are reported in ``damaged`` and never touched, and a checkpoint the writer's retention
deletes while it is read is looked up again (``restore.read_newest``).
"""

from __future__ import annotations

import abc
import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import Any

from mpckpt._commit.sink import ErrorSink
from mpckpt._dist.group import RankGroup
from mpckpt._futures import CheckpointerStats
from mpckpt._read.load import load_checkpoint, load_state
from mpckpt._read.restore import read_newest
from mpckpt.catalog import Catalog, scan
from mpckpt.checkpoint import Checkpoint
from mpckpt.errors import CheckpointNotFoundError, ConfigError, MpckptError
from mpckpt.format.dcp_metadata import is_dcp_folder
from mpckpt.format.manifest import Manifest
from mpckpt.format.names import MANIFEST_NAME, checkpoint_name, step_of
from mpckpt.storage import Backend, open_backend, spec_for_url


class ReadsCommitted(abc.ABC):
    """Steps, best, one checkpoint, a load and a restore, over what ``committed()`` lists.

    The class that mixes it in gives ``backend``, ``committed()``, ``reading(step)`` (retention
    keeps a step while it is read) and ``complete(manifest)`` (a job's rank other than 0 learns
    only a summary at a commit), and everything ``restore.View`` names.
    """

    backend: Backend

    @abc.abstractmethod
    def committed(self) -> dict[int, Manifest]:
        """The committed checkpoints by step."""

    @abc.abstractmethod
    def reading(self, step: int | None) -> contextlib.AbstractContextManager[None]:
        """Retention keeps ``step`` while the block runs."""

    @abc.abstractmethod
    def complete(self, manifest: Manifest) -> Manifest:
        """``manifest`` with its files (a summary is read whole from storage)."""

    def catalog(self) -> Catalog:
        return Catalog(self.committed())

    def checkpoint(self, step: int | None) -> Checkpoint:
        """The committed checkpoint of ``step`` (default: the latest) as a ``Checkpoint``."""
        manifest = self.complete(self.catalog().manifest(step, self.backend.url))
        name = checkpoint_name(manifest.step)
        return Checkpoint(f"{self.backend.url}/{name}", _stored=(self.backend, name, manifest))

    def load(self, step: int | None, *, allow_pickle: bool, classes: bool) -> Any:
        """The plain nested state of committed ``step`` (default: the latest), kept from retention
        while it is read (gone meanwhile: ``CheckpointNotFoundError``, never half read)."""
        with self.reading(step if step is not None else self.catalog().latest_step):
            stored = self.checkpoint(step)._stored
            assert stored is not None
            return load_checkpoint(*stored, allow_pickle=allow_pickle, classes=classes)


class StorageView(ReadsCommitted):
    """What a read-only Checkpointer holds: its root, listed anew for every question."""

    read_only = True
    leave_in_memory = False  # what close() is told of memory: a read-only view keeps none
    pool = None

    def __init__(self, backend: Backend, timeout_s: float = 0.0) -> None:
        self.backend, self.timeout_s = backend, timeout_s
        self.group = RankGroup.of_one()  # a reader reads by itself, in a job too
        self.closed = False
        self.stats = CheckpointerStats()
        self.damaged: dict[int, Exception] = {}
        self.errors = ErrorSink()

    def committed(self) -> dict[int, Manifest]:
        problems: dict[int, Exception] = {}
        found = scan(self.backend, clean=False, problems=problems)
        self.damaged = problems
        return found

    def latest_step(self) -> int | None:
        return max(self.committed(), default=None)

    @contextlib.contextmanager
    def reading(self, step: int | None) -> Iterator[None]:
        yield  # nothing to keep: this process deletes nothing

    def complete(self, manifest: Manifest) -> Manifest:
        return manifest

    def set_aside(self, steps: list[int], *, move: bool = True) -> list[str]:
        raise ConfigError(f"a read-only view of {self.backend.url} moves nothing aside; open a Checkpointer that writes")

    @property
    def wait_s(self) -> float:
        return self.timeout_s

    def wait(self, timeout_s: float) -> None:
        return None

    def close(self) -> None:
        self.closed = True

    release_unclosed = close


def load(root: str | os.PathLike[str], step: int | None = None, *, allow_pickle: bool = False,
         storage_options: Mapping[str, Any] | None = None, classes: bool = True) -> Any:
    """The plain nested state (dicts of tensors) of the latest committed checkpoint, or ``step``.

    Values come back as they were saved (numpy arrays, namedtuples, dataclasses, Enum members
    ...). With ``classes=False`` namedtuples and dataclasses come back as dicts of their fields
    and Enum members as their names, without importing their classes: a checkpoint whose
    classes were renamed or removed still loads.

    ``root`` may also be the path or URL of one checkpoint's folder (``runs/exp1/step_0000000042``,
    what Ray Train's ``Result.checkpoint.path`` holds): that checkpoint is loaded.

    ``root`` may also be a plain torch.distributed.checkpoint folder (``dcp.save(sd,
    checkpoint_id=...)``): its state with every tensor whole, read without running code from
    storage (``_read.dcp_folder``; ``allow_pickle`` as for values).

    Needs no model or optimizer objects and never writes. Every file is verified. A reader
    may run beside a live writer whose retention deletes old checkpoints: a checkpoint deleted
    while it is read, or between listing and reading its manifest, is not damage; the newest
    one is looked up again.
    """
    options = dict(storage_options or {})
    folder = _checkpoint_folder(root, options)
    if folder is not None:
        parent, folder_step = folder
        if step is not None and step != folder_step:
            raise CheckpointNotFoundError(f"{root} is the checkpoint of step {folder_step}, not of step {step}")
        return _newest(parent, folder_step, allow_pickle=allow_pickle, classes=classes)
    backend = open_backend(spec_for_url(root, options))
    if is_dcp_folder(backend):  # a plain torch.distributed.checkpoint folder: one state, no steps
        if step is not None:
            raise CheckpointNotFoundError(f"{root} is a torch.distributed.checkpoint folder (one state, no steps); "
                                          f"load it without step={step}")
        from mpckpt._read.dcp_folder import load_dcp_folder  # (only a DCP folder's load pays its import)

        return load_dcp_folder(backend, allow_pickle=allow_pickle)
    return _newest(backend, step, allow_pickle=allow_pickle, classes=classes)


def _checkpoint_folder(root: str | os.PathLike[str], options: dict[str, Any]) -> tuple[Backend, int] | None:
    """``(backend of the parent root, step)`` when ``root`` names one committed checkpoint's folder."""
    text = os.fspath(root).rstrip("/")
    head, _, name = text.rpartition("/")
    step = step_of(name)
    if step is None or not head or head.endswith(":/"):
        return None
    try:
        parent = open_backend(spec_for_url(head, options))
        return (parent, step) if parent.exists(f"{name}/{MANIFEST_NAME}") else None
    except MpckptError:
        return None


def _newest(backend: Backend, step: int | None, *, allow_pickle: bool, classes: bool) -> Any:
    found = read_newest(StorageView(backend), lambda source: load_state(source, allow_pickle=allow_pickle,
                                                                        classes=classes),
                        step=step, explain=False, kind=None)
    if found is None:
        raise CheckpointNotFoundError(f"no committed checkpoint in {backend.url}")
    return found[1]
