"""One rank of a job for ``test_dcp_writer``: DCP's save and load through mpckpt's ``StorageWriter`` /
``StorageReader``. Run under torchrun (or as a plain process with RANK / WORLD_SIZE / MASTER_ADDR /
MASTER_PORT set) as ``dcp_worker.py SCENARIO ROOT OUT``; what the ranks saw goes into the folder ``OUT``.

``save``  FSDP2 + AdamW (``dist_worker.build_model``); steps 1 and 2 each train, then save
          ``get_state_dict(model, opt)`` with ``dcp.async_save`` (thread executor, on a gloo group of its own,
          DCP's planner with its plan cache, so step 2's local plans come from it) through
          ``StorageWriter(ckpt, step)``: step 1 with DCP's default stager, step 2 by ``checkpoint_id`` with a
          shared-memory ``DefaultStager``. Rank 0 dumps the full tensors of every step (``full-<step>.pt``, gathered on the
          training thread while the save runs); then step 3 is saved by mpckpt's own ``ckpt.save`` (the model
          only). Every rank writes its view (``save-r<rank>.json``).
``load``  a fresh FSDP2 model (other weights) and a fresh optimizer at this world size: ``dcp.load`` of
          ``get_state_dict`` through ``StorageReader(ckpt)`` with ``checkpoint_id`` naming step 2, then
          ``set_state_dict``; then another fresh model from the latest step (3, the native save). Rank 0
          dumps the full tensors (``loaded-w<world>.pt``, ``loaded-native-w<world>.pt``).
``kill``  step 1 is saved with ``dcp.save``; at step 2 rank 1 SIGKILLs itself inside ``write_data``
          (before its part is snapshotted): rank 0's ``write_data`` waits for a commit that needs rank 1's
          part, and DCP's gather finds rank 1 gone; rank 0 records what it got (``kill-r0.json``).
"""

from __future__ import annotations

import argparse
import io
import os
import signal
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

import mpckpt
from harness.job import build_model, full, init_group, train_step, write_json
from mpckpt.errors import MpckptError
from mpckpt.integrations.dcp import StorageReader, StorageWriter


def full_flat(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of DCP's state dict of ``model`` and ``opt``, whole (a collective: every rank calls it)."""
    sd_model, sd_optim = get_state_dict(model, opt)
    out = {f"model.{k}": full(v) for k, v in sd_model.items()}
    for fqn, moments in sd_optim["state"].items():
        out.update({f"optim.{fqn}.{k}": full(v) for k, v in moments.items() if isinstance(v, torch.Tensor)})
    return out


def save(args: argparse.Namespace, rank: int, world: int, out: Path) -> None:
    model, opt = build_model("fsdp", 0, world)
    dcp_group = dist.new_group(backend="gloo")  # DCP's background thread talks on its own group
    view: dict[str, Any] = {}
    stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=True, use_async_staging=False,
                                          use_non_blocking_copy=False))
    with mpckpt.Checkpointer(args.root, workers=1, timeout_s=60) as ckpt:
        for step in (1, 2):
            train_step(model, opt, step, rank)
            sd_model, sd_optim = get_state_dict(model, opt)
            state = {"model": sd_model, "optim": sd_optim, "step": step, "blob": io.BytesIO(b"\x00raw\xff%d" % step)}
            planner = DefaultSavePlanner(enable_plan_caching=True)  # step 2's local plans come from DCP's cache
            if step == 1:
                future = dcp.async_save(state, storage_writer=StorageWriter(ckpt, step), process_group=dcp_group,
                                        planner=planner)
            else:
                future = dcp.async_save(state, storage_writer=StorageWriter(ckpt), checkpoint_id=str(step),
                                        process_group=dcp_group, planner=planner, async_stager=stager)
            dumped = full_flat(model, opt)  # training-thread collectives while the save runs in DCP's thread
            if rank == 0:
                torch.save(dumped, out / f"full-{step}.pt")
            future.result()
            view[f"latest-after-{step}"] = ckpt.latest_step
        stager.close()
        ckpt.save(3, {"model": model, "step": 3})  # mpckpt's own multi-rank save, which StorageReader reads too
        ckpt.wait()
        view.update(steps=ckpt.steps(), saves=[s.status for s in ckpt.stats.saves])
    write_json(out / f"save-r{rank}.json", view)


def load(args: argparse.Namespace, rank: int, world: int, out: Path) -> None:
    model, opt = build_model("fsdp", 1, world)  # other weights, no optimizer state
    train_step(model, opt, 0, rank)  # DCP's optimizer state dict of a fresh optimizer needs its state made
    with mpckpt.Checkpointer(args.root, workers=1, timeout_s=60) as ckpt:
        sd_model, sd_optim = get_state_dict(model, opt)
        state = {"model": sd_model, "optim": sd_optim, "step": -1, "blob": None}
        dcp.load(state, storage_reader=StorageReader(ckpt), checkpoint_id="step_0000000002")
        assert isinstance(state["blob"], io.BytesIO), type(state["blob"])  # DCP's raw bytes, stored without pickle
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        dumped = full_flat(model, opt)
        if rank == 0:
            torch.save(dumped, out / f"loaded-w{world}.pt")
        other, _ = build_model("fsdp", 2, world)
        native = {"model": get_model_state_dict(other), "step": -1}
        dcp.load(native, storage_reader=StorageReader(ckpt))  # the latest: step 3, saved by ckpt.save
        set_model_state_dict(other, native["model"])
        dumped = {f"model.{k}": full(v) for k, v in get_model_state_dict(other).items()}
        if rank == 0:
            torch.save(dumped, out / f"loaded-native-w{world}.pt")
        write_json(out / f"load-r{rank}.json", {"step": state["step"], "native_step": native["step"],
                                                "blob": state["blob"].getvalue().hex(),
                                                "latest": ckpt.latest_step})


class KillingWriter(StorageWriter):
    """Rank 1 dies inside DCP's ``write_data`` of step 2, before it hands mpckpt its part."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        if self.step == 2 and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().write_data(plan, planner)


def kill(args: argparse.Namespace, rank: int, world: int, out: Path) -> None:
    model, opt = build_model("fsdp", 0, world)
    ckpt = mpckpt.Checkpointer(args.root, workers=1, timeout_s=10)
    doc: dict[str, Any] = {"dcp_error": None, "error": None}
    for step in (1, 2):
        train_step(model, opt, step, rank)
        sd_model, sd_optim = get_state_dict(model, opt)
        try:
            dcp.save({"model": sd_model, "optim": sd_optim}, storage_writer=KillingWriter(ckpt, step))
        except Exception as e:  # DCP's gather finds rank 1 gone
            doc["dcp_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            break
    try:
        ckpt.wait()  # step 2's failure was seen by write_data already: nothing more to raise
    except MpckptError as e:
        doc["error"] = {"type": type(e).__name__, "step": getattr(e, "step", None), "ranks": getattr(e, "ranks", None)}
    doc.update(latest=ckpt.latest_step, statuses=[s.status for s in ckpt.stats.saves])
    write_json(out / f"kill-r{rank}.json", doc)
    os._exit(0)  # the group has a dead member: tearing it down could wait on it


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["save", "load", "kill"])
    parser.add_argument("root")
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    rank, world = init_group()
    args.out.mkdir(parents=True, exist_ok=True)
    {"save": save, "load": load, "kill": kill}[args.scenario](args, rank, world, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
