"""One rank of a 2-rank job for ``test_dcp_folders``, run under torchrun (gloo on CPU) as
``dcp_folder_worker.py SCENARIO FOLDER OUT``:

``save``   FSDP2 (every Linear, then the whole) with AdamW, two training steps, then
           ``dcp.save`` of ``{"model", "optim", "epoch"}`` (DTensor shards, plain values) with
           DCP's default FileSystemWriter into FOLDER; rank 0 writes the full tensors
           (``DTensor.full_tensor()``) to ``OUT/full.pt``.
``load``   a fresh FSDP2 model (other weights) and optimizer (one step taken, so its state
           exists) ``dcp.load`` FOLDER: DCP's planner reads each rank's shard out of the whole
           tensors; rank 0 writes the full tensors to ``OUT/loaded.pt``.
"""

from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

IN, HIDDEN, OUT_DIM = 12, 33, 3  # 7, 33 and 3 rows: uneven over 2 ranks


def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(IN, 7), torch.nn.ReLU(), torch.nn.Linear(7, HIDDEN), torch.nn.ReLU(),
                                torch.nn.Linear(HIDDEN, OUT_DIM))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    x, y = torch.randn(8, IN, generator=g), torch.randn(8, OUT_DIM, generator=g)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Every tensor of the model and the optimizer's moments whole (a collective: every rank calls it)."""
    from torch.distributed.tensor import DTensor

    def full(v: Any) -> Any:
        return v.full_tensor() if isinstance(v, DTensor) else v.detach().clone() if isinstance(v, torch.Tensor) else v

    return {"model": {k: full(v) for k, v in model.state_dict().items()},
            "optim": {i: {k: full(v) for k, v in s.items()} for i, s in opt.state_dict()["state"].items()}}


def main() -> None:
    scenario, folder, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    if scenario == "save":
        model, opt = build(seed=0)
        for step in range(2):
            train_step(model, opt, step)
        dcp.save({"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 2}, checkpoint_id=folder)
        name = "full.pt"
    else:
        model, opt = build(seed=1)
        train_step(model, opt, 9)
        sd = {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": -1}
        dcp.load(sd, checkpoint_id=folder)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])
        assert sd["epoch"] == 2, sd["epoch"]
        name = "loaded.pt"
    whole = full_state(model, opt)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(whole, out / f"{name}.part")
        os.replace(out / f"{name}.part", out / name)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
