"""A small torch.distributed job's parts that tests and benchmarks share: the gloo group under
torchrun (and across its restarts), a model under DDP or FSDP2, its deterministic training step,
the global generators, full tensors of DTensors, and JSON written whole."""

from __future__ import annotations

import datetime
import json
import os
import random
from pathlib import Path
from typing import Any

import numpy
import torch
import torch.distributed as dist

IN, HIDDEN, OUT_DIM = 12, 33, 3  # 7, 33 and 3 rows: uneven over 2 and 3 ranks


def init_group() -> tuple[int, int]:
    """The gloo group. Under torchrun its store is the agent's, under a prefix of this attempt: after a
    restart a group initialized plainly fails in connectFullMesh (torch 2.13)."""
    timeout = datetime.timedelta(seconds=60)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if "TORCHELASTIC_RESTART_COUNT" in os.environ:
        base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=timeout)
        store = dist.PrefixStore(f"attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", base)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world, timeout=timeout)
    return rank, world


def attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def build_model(kind: str, seed: int, world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(IN, 7), torch.nn.ReLU(), torch.nn.Linear(7, HIDDEN), torch.nn.ReLU(),
                                torch.nn.Linear(HIDDEN, OUT_DIM))
    return parallel(model, kind, world)


def parallel(model: torch.nn.Sequential, kind: str, world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """``model`` under DDP (``kind == "ddp"``) or FSDP2 (every Linear, then the whole), with AdamW."""
    if kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def seed_generators(seed: int) -> None:
    """torch's, Python's and numpy's global generators (what ``RNGState`` holds)."""
    torch.manual_seed(seed)
    random.seed(seed)
    numpy.random.seed(seed)


def draw(path: Path) -> None:
    """Draw from each global generator, into ``path``."""
    torch.save({"torch": torch.rand(3), "python": random.random(), "numpy": torch.from_numpy(numpy.random.rand(2))},
               path)


def module_of(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, rank: int, batch: int = 8) -> None:
    g = torch.Generator().manual_seed(1000 * step + rank)  # the global generators are left alone
    x, y = torch.randn(batch, IN, generator=g), torch.randn(batch, OUT_DIM, generator=g)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()


def full(value: Any) -> torch.Tensor:
    """The whole tensor of a DTensor (a collective: every rank calls it) or a copy of a plain one."""
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value.detach().clone()


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """What ``mpckpt.load`` should give for the model and the optimizer's moments, as full tensors."""
    tensors = {k: full(v) for k, v in module_of(model).state_dict().items()}
    moments = {i: {k: full(v) for k, v in s.items() if isinstance(v, torch.Tensor)}
               for i, s in opt.state_dict()["state"].items()}
    return {"model": tensors, "optim": moments}


def write_json(path: Path, doc: Any) -> None:
    tmp = path.with_suffix(".part")
    tmp.write_text(json.dumps(doc))
    tmp.replace(path)
