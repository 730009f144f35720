"""Lightning's sharded checkpoints through mpckpt: ``MpckptFSDPStrategy`` and ``MpckptModelParallelStrategy``.

This module owns the saves and loads that Lightning's FSDP strategy (``state_dict_type="sharded"``)
and ModelParallel strategy (``save_distributed_checkpoint=True``) make with
``torch.distributed.checkpoint`` on every rank, bypassing ``CheckpointIO``: each strategy here is
Lightning's own with ``save_checkpoint``, ``load_checkpoint`` and ``remove_checkpoint`` routed
through an mpckpt root (``mpckpt.integrations.dcp``'s ``StorageWriter`` / ``StorageReader``).
Full state dicts (``state_dict_type="full"``, ``save_distributed_checkpoint=False``) are
Lightning's own path, through ``CheckpointIO`` (``MpckptCheckpointIO`` when given).

A save inside the Trainer's loops gives DCP what Lightning would (the sharded model and
optimizer states, DCP's planners sharding) for step N of the root, with Lightning's other
entries (loops, callbacks, hyperparameters: its ``meta.pt``) as the bytes of their
``torch.save`` in the same step. ModelParallel (DTensor states): ``dcp.async_save`` on a gloo
group of the strategy's own, returning after DCP's staging copy; one save in flight, committed
before the next sharded save, load, removal or ``teardown`` goes on. FSDP (ShardedTensor states,
which DCP's stager cannot copy): ``dcp.save``, returning once every rank's part is committed.
The path Lightning names holds a *pointer* (``lightning_files``, marked ``sharded``) naming that
step: written before the save with the steps it named before, narrowed to the new one after the
commit, so a crash at any instant leaves the path naming a committed step or the previous ones.
Every rank opens one Checkpointer of the root (the job's process group) at the first save or
load, closed at ``teardown``. Steps carry ``lightning_file`` / ``lightning_save_id`` as
``MpckptCheckpointIO``'s do; retention (``_KeepFiles``, the same decision on every rank) keeps
the newest step of each file until top-k removes the file, then lets it go at the next commit.

A save outside the loops (``trainer.save_checkpoint`` after ``fit``) is Lightning's own plain
DCP folder, and loads as one. ``load_checkpoint`` of a pointer restores the newest committed
step it names into the sharded model and optimizers (each rank reading its part, resharded by
DCP's planner), and returns Lightning's other entries with ``torch.load(weights_only=...)``.
"""

from __future__ import annotations

import abc
import concurrent.futures
import io
import logging
import os
import secrets
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mpckpt.integrations import require

_lightning = require("lightning", "lightning")

import torch  # noqa: E402
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy  # noqa: E402
from lightning.pytorch.trainer.states import TrainerFn  # noqa: E402

import mpckpt  # noqa: E402
from mpckpt.errors import ConfigError  # noqa: E402
from mpckpt.integrations import lightning_files as files  # noqa: E402
from mpckpt.integrations.lightning import MpckptCheckpointIO, called_from  # noqa: E402
from mpckpt.integrations.lightning_files import Candidate, read_pointer  # noqa: E402
from mpckpt.policies.retention import RetentionPolicy  # noqa: E402

__all__ = ["MpckptFSDPStrategy", "MpckptModelParallelStrategy"]

log = logging.getLogger("mpckpt")

META_KEY = "lightning_meta"  # Lightning's other entries: the bytes of their torch.save (its meta.pt)


class _KeepFiles(RetentionPolicy):
    """Keep the newest step of each Lightning file, until top-k removes the file (``removed``: a
    file's name -> the newest step it had then); steps of no Lightning file are kept."""

    def __init__(self) -> None:
        self.removed: dict[str, int] = {}

    def votes(self, records: Sequence[tuple[int, Any]]) -> list[bool]:
        newest: dict[str, int] = {}
        for step, manifest in records:
            name = manifest.metrics.get(files.FILE_METRIC)
            if isinstance(name, str):
                newest[name] = step
        out = []
        for step, manifest in records:
            name = manifest.metrics.get(files.FILE_METRIC)
            out.append(not isinstance(name, str) or (newest[name] == step and self.removed.get(name, -1) < step))
        return out


@dataclass
class _Pending:
    """The sharded save in flight: DCP's future, and what its path names once it is committed."""

    future: Any
    path: str
    cand: Candidate
    older: list[Candidate]
    extra: dict[str, Any]
    folder: bool  # a plain DCP folder at the path, replaced once committed


class _ShardedSaves:
    """What both strategies add to Lightning's: sharded saves, loads and removals through mpckpt."""

    _MODEL_KEY = "model"
    _ASYNC = False  # dcp.async_save (DTensor states), else dcp.save

    # -- set by the strategy class ---------------------------------------------------------------
    @abc.abstractmethod
    def _sharded(self) -> bool:
        """Whether this strategy saves sharded (DCP) checkpoints now."""

    @abc.abstractmethod
    def _load_sharded(self, ckpt: mpckpt.Checkpointer, step: int) -> None:
        """Load the model (and optimizers when fitting) of committed ``step`` through DCP."""

    # -- the roots this rank holds open ------------------------------------------------------------
    def _mp(self) -> dict[str, Any]:
        held = self.__dict__.get("_mpckpt")
        if held is None:
            held = self.__dict__["_mpckpt"] = {"open": {}, "next": {}, "keep": {}}
        return held  # type: ignore[no-any-return]

    def _options(self) -> tuple[str | None, dict[str, Any]]:
        io_ = self.checkpoint_io  # type: ignore[attr-defined]
        if isinstance(io_, MpckptCheckpointIO):
            return io_.root, dict(io_.options)
        return None, {}

    def _root_for(self, path: str) -> str:
        io_ = self.checkpoint_io  # type: ignore[attr-defined]
        if isinstance(io_, MpckptCheckpointIO):
            return io_.root_for(path)  # the plugin's: root=, or the folder's (decided once)
        return files.root_of_folder(files.dirname(path))

    def _writer(self, root: str) -> mpckpt.Checkpointer:
        """The root's Checkpointer, opened by every rank together (the job's process group)."""
        held = self._mp()
        ckpt = held["open"].get(root)
        if ckpt is None:
            keep = held["keep"].setdefault(root, _KeepFiles())
            ckpt = held["open"][root] = mpckpt.Checkpointer(root, keep=keep, **self._options()[1])
            latest = ckpt.latest_step
            held["next"][root] = max(held["next"].get(root, 0), 0 if latest is None else latest + 1)
        return ckpt

    # -- Lightning's Strategy ------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if self._sharded():
            self._settle()  # one sharded save in flight: the previous one is committed (and its pointer written)
        if not self._sharded() or called_from() != "loop":
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)  # type: ignore[misc]
            return
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options; pass them once as "
                            "MpckptCheckpointIO(storage_options=...) (they go to the mpckpt root)")
        path = files.norm(self.broadcast(filepath))  # type: ignore[attr-defined]
        root = self._root_for(path)
        ckpt = self._writer(root)
        step = self._mp()["next"][root]
        state: dict[str, Any] = {self._MODEL_KEY: checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        meta, save_id = self.broadcast(  # type: ignore[attr-defined]
            (_saved_bytes(checkpoint), secrets.randbits(48)) if self.is_global_zero else None)  # type: ignore[attr-defined]
        state[META_KEY] = torch.frombuffer(bytearray(meta), dtype=torch.uint8)
        cand = Candidate(root, step, save_id)
        metrics: dict[str, Any] = {files.SAVE_ID_METRIC: save_id, files.FILE_METRIC: files.file_metric(root, path)}
        for key, name in (("global_step", "lightning_global_step"), ("epoch", "lightning_epoch")):
            value = checkpoint.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                metrics[name] = value
        extra = {"epoch": checkpoint.get("epoch"), "global_step": checkpoint.get("global_step"), "sharded": True}
        older: list[Candidate] = []
        folder = os.path.isdir(path) and not os.path.islink(path)  # a plain DCP folder: replaced after the commit
        if self.is_global_zero and not folder:  # type: ignore[attr-defined]
            pointer = read_pointer(path)
            older = [] if pointer is None else files.candidates(path, pointer)
            files.write_pointer(path, [cand, *older], **extra)
        from torch.distributed.checkpoint import async_save, save

        from mpckpt.integrations.dcp import StorageWriter

        held = self._mp()
        held["next"][root] = step + 1
        pending = _Pending(concurrent.futures.Future(), path, cand, older, extra, folder)
        writer = StorageWriter(ckpt, step, metrics=metrics)
        try:
            if self._ASYNC:  # DCP copies the state here (its stager), then plans and writes in its thread
                pending.future = async_save(state, storage_writer=writer, process_group=self._dcp_group())
            else:  # DCP's stager cannot copy a ShardedTensor (FSDP1): saved and committed before returning
                save(state, storage_writer=writer)
                pending.future.set_result(None)
        except BaseException:
            self._fall_back(pending)
            raise
        held["pending"] = pending
        if not self._ASYNC:
            self._settle()

    def _dcp_group(self) -> Any:
        """A gloo group for DCP's thread only (training talks on the default group meanwhile)."""
        held = self._mp()
        if held.get("group") is None:
            import torch.distributed as dist

            held["group"] = dist.new_group(backend="gloo")  # every rank, at its first sharded save
        return held["group"]

    def _settle(self) -> None:
        """Wait for the sharded save in flight (every rank's part committed), then narrow its
        pointer to its step; a failure puts the pointer back and is raised."""
        pending = self._mp().pop("pending", None)
        if pending is None:
            return
        try:
            pending.future.result()
        except BaseException:
            self._fall_back(pending)
            raise
        if self.is_global_zero:  # type: ignore[attr-defined]
            if pending.folder and os.path.isdir(pending.path):
                shutil.rmtree(pending.path)
            files.write_pointer(pending.path, [pending.cand], **pending.extra)

    def _fall_back(self, pending: _Pending) -> None:
        """A save that failed: its path names what it named before (or goes)."""
        if self.is_global_zero and not pending.folder:  # type: ignore[attr-defined]
            if pending.older:
                files.write_pointer(pending.path, pending.older, **pending.extra)
            else:
                files.remove(pending.path)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        self._settle()
        path = files.norm(self.broadcast(checkpoint_path))  # type: ignore[attr-defined]
        pointer = self.broadcast(read_pointer(path) if self.is_global_zero else None)  # type: ignore[attr-defined]
        if pointer is None or not pointer.get("sharded"):
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)  # type: ignore[misc, no-any-return]
        if not self._sharded():
            raise ConfigError(f"{path} is a sharded checkpoint in an mpckpt root: load it with "
                              f"{type(self).__name__} saving sharded checkpoints (see docs/integrations/dcp.md)")
        tried = []
        for cand in files.candidates(path, pointer):
            ckpt = self._writer(cand.root)
            if cand.step in ckpt.steps() and \
                    ckpt.checkpoint(cand.step).metrics.get(files.SAVE_ID_METRIC) == cand.save_id:
                self._load_sharded(ckpt, cand.step)
                return _loaded_meta(ckpt, cand.step, weights_only)
            tried.append(f"step {cand.step} of {cand.root}")
        raise FileNotFoundError(f"{path} names no committed checkpoint ({', '.join(tried) or 'no step'}); the steps "
                                "that are: `mpckpt ls <root>`; resume from an older file (ckpt_path=...)")

    def remove_checkpoint(self, filepath: Any) -> None:
        if not self._sharded():
            super().remove_checkpoint(filepath)  # type: ignore[misc]
            return
        self._settle()  # (a save of this path still in flight would write its pointer again)
        path = files.norm(filepath)  # ModelCheckpoint calls this on every rank, with the same path
        root = self._root_for(path)
        held = self._mp()
        if root in held["open"]:  # every rank marks it: retention lets its steps go at the next commit
            held["keep"][root].removed[files.file_metric(root, path)] = held["next"][root] - 1
        if self.is_global_zero:  # type: ignore[attr-defined]
            if not files.is_url(path) and os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)  # a plain DCP folder (a save outside the loops)
            else:
                files.remove(path)

    def teardown(self) -> None:
        held = self._mp()
        first: BaseException | None = None
        try:
            self._settle()
        except BaseException as e:  # still close
            first = e
        for root, ckpt in list(held["open"].items()):
            try:
                ckpt.close()
            except BaseException as e:
                first = first or e
            held["open"].pop(root, None)
        group, held["group"] = held.get("group"), None
        if group is not None:
            import torch.distributed as dist

            dist.destroy_process_group(group)
        super().teardown()  # type: ignore[misc]
        if first is not None:
            raise first


def _saved_bytes(checkpoint: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    return buffer.getvalue()


def _loaded_meta(ckpt: mpckpt.Checkpointer, step: int, weights_only: bool | None) -> dict[str, Any]:
    """Lightning's other entries of ``step``, as Lightning loads its ``meta.pt``."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    from mpckpt.integrations.dcp import StorageReader

    data = _load_state_dict_from_keys({META_KEY}, storage_reader=StorageReader(ckpt, step))[META_KEY]
    meta = torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=weights_only)
    if not isinstance(meta, dict):
        raise ConfigError(f"step {step} of {ckpt.url} holds no Lightning checkpoint entries")
    return meta


class MpckptFSDPStrategy(_ShardedSaves, FSDPStrategy):  # type: ignore[misc]
    """Lightning's ``FSDPStrategy``; with ``state_dict_type="sharded"`` its checkpoints go into an
    mpckpt root through DCP (``plugins=[MpckptCheckpointIO(...)]`` gives the root and the
    Checkpointer's options). On a CPU root device (gloo), FSDP is given the CPU as its device."""

    def _sharded(self) -> bool:
        return bool(self._state_dict_type == "sharded")

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel

        if self.root_device.type != "cpu" or any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
            return super()._setup_model(model)  # type: ignore[no-any-return]
        # Lightning gives FSDP device_id=None on the CPU, which FSDP refuses; torch.device("cpu") runs
        from lightning.fabric.strategies.fsdp import _setup_activation_checkpointing

        model = FullyShardedDataParallel(module=model, cpu_offload=self.cpu_offload,
                                         mixed_precision=self.mixed_precision_config,
                                         sharding_strategy=self.sharding_strategy, device_id=torch.device("cpu"),
                                         **self.kwargs)
        _setup_activation_checkpointing(model, self._activation_checkpointing_kwargs)
        return model

    def _load_sharded(self, ckpt: mpckpt.Checkpointer, step: int) -> None:
        from lightning.fabric.strategies.fsdp import _get_sharded_state_dict_context
        from torch.distributed.checkpoint import load
        from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        from mpckpt.integrations.dcp import StorageReader

        assert self.model is not None and self.lightning_module is not None
        with _get_sharded_state_dict_context(self.model):  # type: ignore[attr-defined]  # a context manager
            module_state = {"model": self.model.state_dict()}
            load(module_state, storage_reader=StorageReader(ckpt, step))
            self.model.load_state_dict(module_state["model"], strict=self.lightning_module.strict_loading)
            if self.lightning_module.trainer.state.fn == TrainerFn.FITTING and self.optimizers:
                for idx, optim in enumerate(self.optimizers):
                    key = f"optimizer_{idx}"
                    state = load_sharded_optimizer_state_dict(model_state_dict=module_state["model"],
                                                              optimizer_key=key,
                                                              storage_reader=StorageReader(ckpt, step))
                    optim.load_state_dict(FSDP.optim_state_dict_to_load(optim_state_dict=state[key],
                                                                        model=self.model, optim=optim))


class MpckptModelParallelStrategy(_ShardedSaves, ModelParallelStrategy):  # type: ignore[misc]
    """Lightning's ``ModelParallelStrategy`` (FSDP2 / tensor parallel); with
    ``save_distributed_checkpoint=True`` (its default) its checkpoints go into an mpckpt root
    through DCP (``plugins=[MpckptCheckpointIO(...)]`` gives the root and the options)."""

    _MODEL_KEY = "state_dict"
    _ASYNC = True

    def _sharded(self) -> bool:
        return bool(self._save_distributed_checkpoint)

    def _load_sharded(self, ckpt: mpckpt.Checkpointer, step: int) -> None:
        from torch.distributed.checkpoint import load
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        from mpckpt.integrations.dcp import StorageReader

        assert self.model is not None and self.lightning_module is not None
        module_state = {self._MODEL_KEY: get_model_state_dict(self.model)}
        load(module_state, storage_reader=StorageReader(ckpt, step))
        self.model.load_state_dict(module_state[self._MODEL_KEY], strict=self.lightning_module.strict_loading)
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        for idx, optim in enumerate(self.optimizers if fitting else []):  # (test() after fit() keeps fit's)
            key = f"optimizer_{idx}"
            state = {key: get_optimizer_state_dict(self.model, optim)}
            load(state, storage_reader=StorageReader(ckpt, step))
            set_optimizer_state_dict(self.model, optim, optim_state_dict=state[key],
                                     options=StateDictOptions(cpu_offload=True))
