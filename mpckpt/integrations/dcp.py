"""torch.distributed.checkpoint (DCP) as a front door: ``StorageWriter`` and ``StorageReader``.

``dcp.save(sd, storage_writer=StorageWriter(ckpt, step))`` (or ``dcp.async_save``) and
``dcp.load(sd, storage_reader=StorageReader(ckpt, step))`` over an open ``mpckpt.Checkpointer``
(every rank's): DCP's planners shard and reshard, mpckpt stores. Nothing DCP-specific is
stored: a DCP save becomes an ordinary mpckpt checkpoint of the root, in mpckpt's own format
(one process's, or a job's ranked one), which ``mpckpt.load``, ``mpckpt ls/info/verify/export``,
retention, ``Checkpointer.restore`` and the recovery tier read as any other; and
``StorageReader`` reads any state checkpoint of the root, whoever wrote it.

Saving: every rank's ``write_data`` gives mpckpt its part of the state (``_dcp_state``: each
DCP chunk as a box of its global tensor, as mpckpt stores a DTensor's local shard; each
bytes item as the value itself) and takes an ASYNC save of it: the copy into shared memory,
then the uploader pool and the ledger, as ``Checkpointer.save`` does, without its
collectives (DCP's planning already ran on every rank), then waits for the commit, which
mpckpt makes once every rank's part is durable, in step order: ``dcp.save`` returns, and
``dcp.async_save``'s future resolves, only then, with every rank's Checkpointer knowing it
(``finish`` has nothing left to do). DCP's ``Metadata`` is not stored; its ``.metadata`` is a
pickle, and mpckpt never reads one.

Reading: ``read_metadata`` rebuilds DCP's ``Metadata`` from the manifest and the skeletons
(``_dcp_view``), and ``read_data`` reads each box DCP asks for from the chunks that hold it,
every block verified against its checksum.

``checkpoint_id`` (DCP's, given to ``dcp.save``/``dcp.load`` or set through ``reset``) names
a step of the Checkpointer's root, never a place of its own: the step (``100``, ``"100"``),
the checkpoint's folder name (``"step_0000000100"``) or that folder's path or URL in the root.
DCP's process executor (``AsyncCheckpointerType.PROCESS``) would run the writer in another
process, away from the Checkpointer that holds the shared memory and the uploaders: it is
refused with an error that names the thread executor (mpckpt's uploaders are processes already).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from typing import Any

from torch.distributed.checkpoint import storage as _storage
from torch.futures import Future

from mpckpt import extension
from mpckpt.checkpointer import Checkpointer
from mpckpt.errors import CheckpointNotFoundError, ConfigError, MpckptError
from mpckpt.format.names import checkpoint_name, step_of
from mpckpt.integrations._dcp_state import check_same_keys, held_keys, state_of
from mpckpt.integrations._dcp_view import CheckpointView

__all__ = ["StorageReader", "StorageWriter"]


class _Saving:
    """What the DCP saves of one Checkpointer share: one save at a time, and the items this rank held
    at its last save (DCP's plan cache sends an empty local plan when nothing changed)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.held: list[Any] | None = None


_SAVING: weakref.WeakKeyDictionary[Checkpointer, _Saving] = weakref.WeakKeyDictionary()
_SAVING_LOCK = threading.Lock()


def _step_number(checkpoint_id: Any) -> int | None:
    """The step ``checkpoint_id`` names by itself (a number, or a checkpoint folder's name), or None."""
    if isinstance(checkpoint_id, bool):
        return None
    if isinstance(checkpoint_id, int):
        return checkpoint_id if checkpoint_id >= 0 else None
    if not isinstance(checkpoint_id, (str, os.PathLike)):
        return None
    tail = os.fspath(checkpoint_id).rstrip("/").rpartition("/")[2]
    return int(tail) if tail.isdigit() and tail == os.fspath(checkpoint_id).rstrip("/") else step_of(tail)


def step_of_id(ckpt: Checkpointer, checkpoint_id: Any) -> int:
    """The step of ``ckpt``'s root that DCP's ``checkpoint_id`` names (``ConfigError`` otherwise)."""
    step = _step_number(checkpoint_id)
    text = os.fspath(checkpoint_id) if isinstance(checkpoint_id, (str, os.PathLike)) else str(checkpoint_id)
    head = text.rstrip("/").rpartition("/")[0]
    if step is not None and head and not _same_place(head, ckpt.url):
        step = None
    if step is None:
        raise ConfigError(f"checkpoint_id={checkpoint_id!r} names no step of {ckpt.url}: give the step (100), the "
                          f"checkpoint's folder name ({checkpoint_name(100)!r}) or its path in the root")
    return step


def _same_place(head: str, url: str) -> bool:
    if head.rstrip("/") == url.rstrip("/"):
        return True
    local = url[len("file://"):] if url.startswith("file://") else url
    return "://" not in head and "://" not in local and os.path.realpath(head) == os.path.realpath(local)


class StorageWriter(_storage.StorageWriter):
    """DCP's ``StorageWriter`` over an open writer ``Checkpointer`` (every rank's): each DCP save
    is the mpckpt checkpoint of ``step`` (or of the step ``checkpoint_id`` names), committed once
    every rank's part is durable. ``metrics`` are the checkpoint's (``best``, ``KeepBest``)."""

    def __init__(self, ckpt: Checkpointer, step: int | None = None, *, metrics: dict[str, Any] | None = None) -> None:
        super().__init__()
        if not isinstance(ckpt, Checkpointer):
            raise ConfigError(f"StorageWriter(ckpt, step) takes an open mpckpt.Checkpointer, not {type(ckpt).__name__}")
        extension.check_writer(ckpt)  # a read-only or closed Checkpointer is refused now
        self.ckpt = ckpt
        self.step = None if step is None else step_of_id(ckpt, step)
        self.metrics = extension.check_metrics(metrics)
        self.checkpoint_id: Any = None
        self.is_coordinator = False

    def __reduce__(self) -> Any:
        raise ConfigError("mpckpt's StorageWriter saves through the Checkpointer open in this process, which a DCP "
                          "process executor (AsyncCheckpointerType.PROCESS) cannot reach: use dcp.async_save with the "
                          "thread executor (the default); mpckpt's uploaders already write in processes of their own")

    # -- DCP's calls, in order ------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            step = step_of_id(self.ckpt, checkpoint_id)
            self.step, self.checkpoint_id = step, checkpoint_id

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        if self.step is None:
            raise ConfigError("no step to save: StorageWriter(ckpt, step), or dcp.save(..., checkpoint_id=step)")
        mine, rank = extension.ranks(self.ckpt).rank, kwargs.get("rank")
        if rank is not None and rank != mine:
            raise ConfigError(f"DCP saves as rank {rank}, the Checkpointer is rank {mine} of its group: give DCP and "
                              "the Checkpointer the same process group")

    def storage_meta(self) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        where = None if self.step is None else f"{self.ckpt.url}/{checkpoint_name(self.step)}"
        return StorageMeta(checkpoint_id=where)

    def prepare_local_plan(self, plan: Any) -> Any:
        import dataclasses

        if not plan.usable:  # DCP's plan cache: the same items as last time
            return plan
        _saving(self.ckpt).held = list(plan.items)
        return dataclasses.replace(plan, storage_data=held_keys(plan.items))

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        import dataclasses

        check_same_keys([p.storage_data if p.usable else None for p in plans])
        return [dataclasses.replace(p, storage_data=None) if p.usable else p for p in plans]

    def write_data(self, plan: Any, planner: Any) -> Future[list[_storage.WriteResult]]:
        saving = _saving(self.ckpt)
        if saving.held is None:
            raise ConfigError("DCP sent no local plan (its plan cache) before this Checkpointer's first DCP save")
        state, sizes = state_of(saving.held, plan.items, planner, distributed=extension.ranks(self.ckpt).distributed)
        with saving.lock:  # one DCP save at a time per Checkpointer, in step order
            assert self.step is not None
            future = extension.save_agreed(self.ckpt, self.step, state, metrics=self.metrics,
                                           started=time.perf_counter())
        # every rank waits for the commit here, not the coordinator alone in ``finish``: when DCP returns,
        # each rank's Checkpointer knows the step is committed (latest_step, retention, the next save)
        _committed(future, extension.commit_timeout_s(self.ckpt))
        results = [_storage.WriteResult(index=item.index, size_in_bytes=sizes.get(item.index, 0), storage_data=None)
                   for item in plan.items]
        done: Future[list[_storage.WriteResult]] = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Any, results: list[list[_storage.WriteResult]]) -> None:
        """Nothing left to do: every rank's ``write_data`` returned after the commit. DCP's ``metadata``
        is not stored (``StorageReader`` rebuilds it from the checkpoint; see the module)."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return _step_number(checkpoint_id) is not None


def _committed(future: Any, timeout_s: float) -> None:
    """Wait for the commit of a save (every rank's part durable); raise why it did not commit."""
    done = future.result(timeout_s)
    if done.name is None:
        raise MpckptError(f"step {future.step} was not saved ({future.stats.status}): the memory budget was full "
                          "under policy 'skip' or 'coalesce'; raise memory_budget or use policy='block'")


def _saving(ckpt: Checkpointer) -> _Saving:
    with _SAVING_LOCK:
        found = _SAVING.get(ckpt)
        if found is None:
            found = _SAVING[ckpt] = _Saving()
        return found


class StorageReader(_storage.StorageReader):
    """DCP's ``StorageReader`` over an open ``Checkpointer`` (a writer or ``read_only=True``): reads
    the committed checkpoint of ``step`` (default: the latest), whoever wrote it."""

    def __init__(self, ckpt: Checkpointer, step: int | None = None) -> None:
        super().__init__()
        if not isinstance(ckpt, Checkpointer):
            raise ConfigError(f"StorageReader(ckpt, step) takes an open mpckpt.Checkpointer, not {type(ckpt).__name__}")
        self.ckpt = ckpt
        self.step = None if step is None else step_of_id(ckpt, step)
        self.checkpoint_id: Any = None
        self._view: CheckpointView | None = None
        self._reading: contextlib.ExitStack | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._done()
        if checkpoint_id is not None:
            self.step, self.checkpoint_id = step_of_id(self.ckpt, checkpoint_id), checkpoint_id

    def read_metadata(self) -> Any:
        self._done()
        extension.check_open(self.ckpt)
        step = self.step if self.step is not None else self.ckpt.latest_step
        if step is None:
            raise CheckpointNotFoundError(f"{self.ckpt.url} holds no committed checkpoint yet")
        self._reading = contextlib.ExitStack()
        self._reading.enter_context(extension.holding(self.ckpt, step))  # retention keeps it until read_data is done
        try:
            ranks = extension.ranks(self.ckpt)
            self._view = CheckpointView(extension.source_of(self.ckpt.checkpoint(step)), rank=ranks.rank,
                                        world_size=ranks.world_size, allow_pickle=self.ckpt.config.allow_pickle)
        except BaseException:
            self._done()
            raise
        return self._view.metadata

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._view is None:
            raise ConfigError("DCP set up the reader before reading its metadata")

    def prepare_local_plan(self, plan: Any) -> Any:
        return plan

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        return plans

    def read_data(self, plan: Any, planner: Any) -> Future[None]:
        if self._view is None:
            raise ConfigError("DCP read data before reading the metadata")
        try:
            self._view.read(plan, planner)
        finally:
            self._done()
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _done(self) -> None:
        self._view = None
        reading, self._reading = self._reading, None
        if reading is not None:
            reading.close()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return _step_number(checkpoint_id) is not None
