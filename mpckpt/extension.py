"""The seams an integration builds on: what code adapting mpckpt to a framework may use.

``mpckpt.Checkpointer`` is the API of a training script. An integration (DCP's storage layer,
Lightning's ``CheckpointIO``, the Hugging Face Trainer's callback, the next one for Accelerate,
torchtitan or DeepSpeed) needs a few more things from the core, and takes them from here, never
from ``mpckpt._*`` or an attribute with a leading underscore (``tests/unit/test_integration_seams.py``
checks that of ``mpckpt/integrations``). Each is public and kept stable as the rest of the API:

The job
    ``ranks(ckpt)``: this process's rank, the world size and the rank group (``Ranks``; one
    process is rank 0 of 1).

Guards
    ``check_open(ckpt)`` (a closed Checkpointer, or a background failure not yet reported, raises
    now), ``check_writer(ckpt)`` (also a read-only one), ``check_step(step, last)`` (an int after
    ``last``: ``StepOrderError``), ``check_metrics(metrics)`` (a dict of plain values).

Saving a step the ranks already agreed on
    ``save_agreed(ckpt, step, state, metrics=)``: an ASYNC save, forced, without the collectives
    of ``Checkpointer.save`` (the integration's own planning ran on every rank, as DCP's does);
    the future of its commit. ``commit_timeout_s(ckpt)`` bounds a wait for it.

Reading one committed checkpoint
    ``holding(ckpt, step)``: retention keeps ``step`` while the block reads it.
    ``stored_parts(checkpoint)``: its backend, folder name and manifest (``StoredParts``). ``source_of(checkpoint)``:
    the checkpoint's files as a ``Source`` whose every read is verified against the manifest's
    checksums; ``load_tree(source)`` loads its state whole; ``RegionReader(source)`` reads boxes of a
    job's global tensors and ranks' local ones (``leaf_dtype``, ``build_tree``: a skeleton's tree with
    placeholders of your own). ``with_metrics(checkpoint, metrics)``: the same checkpoint seen with
    more metrics (nothing is written).

Work beside training
    ``Thread`` and ``executor(n, name)``: threads that never start an OpenMP team of their own
    (an extra team slows every CPU training step: ``mpckpt._threads``). ``side_process(ckpt, fn)``:
    a long-lived process that runs ``fn(checkpoint)`` on committed checkpoints, out of the training
    process (what ``validate=`` uses); ``SideProcessFailed`` says why one run gave nothing.

The open's lifetime in a job whose group failed
    ``abandon(ckpt, timeout_s=)``: let go of the open as a crash would leave it, without a collective
    (what it keeps in memory stays for the next restore; saves in flight are dropped and logged).
    ``reopen(ckpt)``: open the same root again, as it was opened, on the process group formed since
    (a collective of the new group). ``mpckpt.heal`` is built on these two.

State shapes
    ``PlacedShard``: a chunk of a global tensor at its offset, written by this rank or not (how a
    job's sharded tensor is stored); put it in the state given to ``save_agreed``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

from mpckpt._codec.dtensor import PlacedShard
from mpckpt._commit.validator_process import ValidationFailed as SideProcessFailed
from mpckpt._commit.validator_process import ValidatorProcess as SideProcess
from mpckpt._commit.validator_process import ValidatorSetup, pickle_fn
from mpckpt._futures import SaveFuture
from mpckpt._opening import open_root
from mpckpt._read.load import load_state as load_tree
from mpckpt._read.regions import Reader as RegionReader
from mpckpt._read.regions import leaf_dtype
from mpckpt._read.skeleton import build as build_tree
from mpckpt._read.sources import Source, StorageSource
from mpckpt._runtime import Runtime
from mpckpt._threads import Thread, executor
from mpckpt.checkpoint import Checkpoint
from mpckpt.checkpointer import Checkpointer, _check_metrics, _check_step
from mpckpt.config import UploadMode
from mpckpt.errors import ConfigError
from mpckpt.format.manifest import Manifest

log = logging.getLogger("mpckpt")

__all__ = [
    "PlacedShard", "Ranks", "RegionReader", "SideProcess", "SideProcessFailed", "Source", "StoredParts", "Thread",
    "abandon", "build_tree", "check_metrics", "check_open", "check_step", "check_writer", "commit_timeout_s", "executor",
    "holding", "leaf_dtype", "load_tree", "ranks", "reopen", "save_agreed", "side_process", "source_of", "stored_parts",
    "with_metrics",
]


@dataclasses.dataclass(frozen=True)
class Ranks:
    """Where this process stands in its job: ``rank`` of ``world_size``; ``group`` is the rank
    group the Checkpointer agrees through (None for one process)."""

    rank: int
    world_size: int
    group: Any = None

    @property
    def distributed(self) -> bool:
        return self.group is not None


@dataclasses.dataclass(frozen=True)
class StoredParts:
    """A committed checkpoint as stored: its storage backend, its folder's name and its manifest."""

    backend: Any
    name: str
    manifest: Manifest


def _checkpointer(ckpt: Any) -> Checkpointer:
    if not isinstance(ckpt, Checkpointer):
        raise ConfigError(f"expected an open mpckpt.Checkpointer, got {type(ckpt).__name__}")
    return ckpt


def ranks(ckpt: Checkpointer) -> Ranks:
    """This process's rank in ``ckpt``'s job, the world size and the rank group (None alone)."""
    group = _checkpointer(ckpt)._rt.group
    return Ranks(group.rank, group.world_size, None if group.alone else group)


def check_open(ckpt: Checkpointer) -> None:
    """Raise if ``ckpt`` is closed, or a background failure of it has not been reported yet."""
    _checkpointer(ckpt)._check_usable()


def check_writer(ckpt: Checkpointer) -> None:
    """As ``check_open``, and a ``ConfigError`` for a Checkpointer opened ``read_only=True``."""
    _checkpointer(ckpt)._writer()


def check_step(step: Any, last: int | None) -> int:
    """``step`` as an int after the last saved step ``last`` (``StepOrderError`` naming both if not)."""
    return _check_step(step, last)


def check_metrics(metrics: Mapping[str, Any] | None) -> dict[str, Any]:
    """``metrics`` as a plain dict (tensors' ``.item()``); a ``ConfigError`` for anything else."""
    return _check_metrics(metrics)


def save_agreed(ckpt: Checkpointer, step: int, state: Any, *, metrics: Mapping[str, Any] | None = None,
                started: float | None = None) -> SaveFuture:
    """Save ``state`` as ``step``, ASYNC and forced, without ``Checkpointer.save``'s collectives:
    for an integration whose ranks already agreed on what each saves (its planning ran on every
    rank). Every rank of a job calls it for the same step; the commit comes once every rank's
    part is durable, in step order. ``started``: the ``perf_counter`` the save's blocked time
    counts from (default now). Returns the future of the commit."""
    started = time.perf_counter() if started is None else started
    rt = _checkpointer(ckpt)._writer()
    step = _check_step(step, rt.ledger.last_step)
    future = rt.save(step, state, _check_metrics(metrics), mode=UploadMode.ASYNC, overlap=False, force=True,
                     started=started, agreed=True)
    assert future is not None  # forced: a save is always taken
    return future


def commit_timeout_s(ckpt: Checkpointer) -> float:
    """How long a wait for one of ``ckpt``'s commits may take (its ``timeout_s`` setting)."""
    return float(_checkpointer(ckpt)._writer().wait_s)


def holding(ckpt: Checkpointer, step: int) -> AbstractContextManager[None]:
    """Retention (``keep=``, ``rm``, a framework's rotation) keeps ``step`` while the block runs."""
    return _checkpointer(ckpt)._rt.reading(step)


def stored_parts(checkpoint: Checkpoint) -> StoredParts:
    """The backend, folder name and manifest of a committed checkpoint from ``Checkpointer.checkpoint``."""
    stored = checkpoint._stored
    if stored is None:
        raise ConfigError(f"{checkpoint.path} is a local folder, not a committed checkpoint of a root: give one that "
                          "Checkpointer.checkpoint(step) returned")
    backend, name, manifest = stored
    return StoredParts(backend, name, manifest)


def source_of(checkpoint: Checkpoint) -> Source:
    """The files of a committed checkpoint, each read verified against the manifest's checksums."""
    parts = stored_parts(checkpoint)
    return StorageSource(parts.backend, parts.name, parts.manifest)


def with_metrics(checkpoint: Checkpoint, metrics: Mapping[str, Any]) -> Checkpoint:
    """``checkpoint`` as a ``Checkpoint`` whose metrics also hold ``metrics`` (nothing is written:
    a side process given it reads them from ``Checkpoint.metrics``)."""
    parts = stored_parts(checkpoint)
    manifest = dataclasses.replace(parts.manifest, metrics={**parts.manifest.metrics, **metrics})
    return Checkpoint(checkpoint.path, _stored=(parts.backend, parts.name, manifest))


def side_process(ckpt: Checkpointer, fn: Callable[[Checkpoint], Any]) -> SideProcess:
    """A process, started now, that runs ``fn(checkpoint)`` on committed checkpoints of ``ckpt``'s
    root: ``.validate(step, name, manifest, timeout_s=, abandoned=)`` runs it once and returns its
    dict (``SideProcessFailed`` when it raised, died or ran out of time), ``.close()`` stops it.
    ``fn`` travels by dill (a module-level function, or a closure whose values pickle). It takes
    the trainer's environment, runs ``nice`` below it and exits with it (as ``validate=``)."""
    ckpt = _checkpointer(ckpt)
    config = ckpt.config
    setup = ValidatorSetup(ckpt._spec, pickle_fn(fn), config.nice, os.getpid(), dict(os.environ))
    return SideProcess(setup, start_method=config.start_method)


def abandon(ckpt: Checkpointer, *, timeout_s: float = 2.0) -> None:
    """Let go of ``ckpt``'s open as a crash would leave it, without a collective and without waiting
    for its saves: what it keeps in memory stays for the next restore, its uploaders and threads stop
    (each part within ``timeout_s``), rank 0 lets go of the root's lock. Saves in flight are dropped (a
    failed group cannot commit them); background failures nobody saw yet are logged. ``reopen`` next."""
    ckpt = _checkpointer(ckpt)
    if ckpt._finalizer is not None:
        ckpt._finalizer.detach()
    rt = ckpt._rt
    if not isinstance(rt, Runtime) or rt.closed:
        return
    rt.leave_in_memory = True
    try:
        rt.release(timeout_s=timeout_s, abort=True)
    finally:
        for e in rt.errors.take_unseen():
            log.info("mpckpt: dropped with the failed group: %s: %s", type(e).__name__, e)


def reopen(ckpt: Checkpointer) -> None:
    """Open ``ckpt``'s root again, as it was opened, on the process group formed since ``abandon``
    (every rank of the new group calls it: the open is a collective)."""
    ckpt = _checkpointer(ckpt)
    if not ckpt._closed:
        raise ConfigError("reopen() opens a Checkpointer that abandon() let go of; this one is still open")
    opened = open_root(ckpt, ckpt._spec.root, ckpt.config, storage_options=None, read_only=False,
                       spec=ckpt._spec)
    ckpt._rt, ckpt._finalizer = opened.runtime, opened.finalizer
