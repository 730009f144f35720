"""The Trainer's own rules that ``MpckptCallback`` follows, and what a save holds of its state.

What the Trainer supports being taken over (``check_supported``: not DeepSpeed, not FSDP), its
``save_total_limit`` and best-model rotation as mpckpt retention (``retention_of``), its strict
best-metric comparison (``record_best``, for ``save_strategy="best"``), the ``trainer_state.json``
it would write at its save point (``trainer_state_of``, with the states of ``ExportableState``
callbacks found on the call stack: ``exportable_callbacks``), and every rank's generators
gathered to rank 0 (``ranks_rng``). ``transformers.py`` decides when each applies.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Mapping
from types import FrameType
from typing import TYPE_CHECKING, Any

import mpckpt
from mpckpt.errors import ConfigError

if TYPE_CHECKING:
    from transformers import TrainerControl, TrainerState, TrainingArguments

SUMMARY_KEY = "train_runtime"  # in the log entry the Trainer appends when training ends


def ranks_rng() -> list[dict[str, Any]] | None:
    """Every rank's ``RNGState`` on rank 0, in rank order (None elsewhere, and in one process)."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mpckpt.RNGState().state_dict(), gathered, dst=0)
    return gathered


def check_supported(args: TrainingArguments) -> None:
    if getattr(args, "deepspeed", None):
        raise ConfigError("MpckptCallback does not save DeepSpeed checkpoints (they keep a format of their own); "
                          "let the Trainer save them, or train without it")
    if getattr(args, "fsdp", None):
        raise ConfigError("MpckptCallback does not take FSDP saves over: with accelerate's FSDP plugin the Trainer "
                          "saves with torch.distributed.checkpoint on every rank (SHARDED_STATE_DICT) or gathers the "
                          "state (FULL_STATE_DICT), and resume_path writes no folder of that layout (on CPU, accelerate "
                          "drops the FSDP plugin and trains unsharded: FSDP needs accelerators). Ways on: let the "
                          "Trainer save them (no MpckptCallback); DDP, which MpckptCallback saves (every rank's "
                          "generators too); FSDP2 in a loop of your own, saved with dcp.save through "
                          "mpckpt.integrations.dcp.StorageWriter; in Lightning, "
                          "mpckpt.integrations.lightning_dcp.MpckptFSDPStrategy")


def retention_of(args: TrainingArguments) -> mpckpt.RetentionPolicy | None:
    """``save_total_limit`` (and the best checkpoint, which the Trainer's rotation keeps) as mpckpt retention."""
    if not args.save_total_limit:
        return None
    keep: mpckpt.RetentionPolicy = mpckpt.KeepLast(int(args.save_total_limit))
    if args.metric_for_best_model:
        keep = keep | mpckpt.KeepBest(1, metric_name(args), "max" if args.greater_is_better else "min")
    return keep


def metric_name(args: TrainingArguments) -> str:
    name = str(args.metric_for_best_model)
    return name if name.startswith("eval_") else f"eval_{name}"


def record_best(args: TrainingArguments, state: TrainerState, metrics: Mapping[str, Any]) -> bool:
    """``save_strategy="best"``: update ``state.best_metric`` / ``best_global_step`` as the Trainer
    would, and say whether it improved.

    The Trainer compares strictly right after every callback's ``on_evaluate`` and saves when the
    metric improved; done here first, its own check finds no improvement and saves nothing. (With
    the other strategies the Trainer records the best itself, before the snapshot is taken.)
    Callbacks after this one in ``callbacks=`` see the new best already in their ``on_evaluate``.
    """
    if not args.metric_for_best_model:
        return False
    name = metric_name(args)
    if name not in metrics:
        return False  # the Trainer raises a KeyError naming the metric right after
    value = float(metrics[name])
    if state.best_metric is None:
        state.best_metric = -math.inf if args.greater_is_better else math.inf
    better = value > state.best_metric if args.greater_is_better else value < state.best_metric
    if better:
        state.best_metric = value
        if args.save_strategy in ("steps", "epoch", "best"):
            state.best_global_step = state.global_step
    return better


def trainer_state_of(state: TrainerState, control: TrainerControl, claimed_at: int) -> dict[str, Any]:
    """The ``trainer_state.json`` the Trainer would write at its save point."""
    data = dataclasses.asdict(state)
    # the summary entry train() appends after the last save point is not part of the checkpoint
    data["log_history"] = [entry for i, entry in enumerate(data["log_history"])
                           if i < claimed_at or SUMMARY_KEY not in entry]
    callbacks = dict(data.get("stateful_callbacks") or {})
    for cb in [*exportable_callbacks(), control]:
        if hasattr(cb, "state") and callable(cb.state):
            callbacks[type(cb).__name__] = cb.state()
    if isinstance(callbacks.get("TrainerControl"), dict) and isinstance(callbacks["TrainerControl"].get("args"), dict):
        callbacks["TrainerControl"]["args"]["should_save"] = True  # as at the Trainer's save (we cleared the flag)
    data["stateful_callbacks"] = callbacks
    return data


def exportable_callbacks() -> list[Any]:
    """The Trainer's callbacks with a state of their own (``ExportableState``: early stopping ...).

    Callbacks are not given the handler; its ``call_event`` frame holds it (a few frames up:
    ``_flush`` <- our event method <- ``call_event``). Nothing found: only ``TrainerControl``.
    """
    from transformers import TrainerControl, trainer_callback

    exportable = getattr(trainer_callback, "ExportableState", None)
    if exportable is None:
        return []
    frame: FrameType | None = sys._getframe(1)
    for _ in range(6):
        if frame is None:
            break
        handler = frame.f_locals.get("self")
        callbacks = getattr(handler, "callbacks", None)
        if isinstance(callbacks, list) and type(handler).__name__ == "CallbackHandler":
            return [cb for cb in callbacks if isinstance(cb, exportable) and not isinstance(cb, TrainerControl)]
        frame = frame.f_back
    return []
