"""A DDP job that survives a lost rank without a relaunch: ``python -m mpckpt.run`` and ``mpckpt.heal``.

Run it on one machine (two ranks, gloo on CPU)::

    python -m mpckpt.run --standalone --nproc-per-node 2 --max-restarts 2 examples/heal_in_place.py

Rank 1 SIGKILLs itself in the middle of step ``--kill-at`` (once, in the first generation): the
launcher starts a replacement, rank 0's process stays and heals in place (``mpckpt.heal``), the
replacement restores its predecessor's snapshot from this machine's memory, and training goes on
from the newest step both ranks held. Every rank prints what happened; rank 0 checks at the end
that its model is bit for bit the one an uninterrupted run reaches (the data of a step depends only
on the step and the rank, so the run is deterministic). ``--kill-at -1``: no kill.
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import mpckpt
from mpckpt import healing


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    return net, torch.optim.AdamW(net.parameters(), lr=1e-3)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    return torch.randn(64, 32, generator=g), torch.randn(64, 1, generator=g)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, rank: int, kill_at: int) -> float:
    x, y = batch(step, rank)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()  # DDP's gradient all-reduce: where the survivor sees the loss
    if step == kill_at and rank == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
        print(f"[rank 1 pid {os.getpid()}] dying in step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    opt.step()
    return loss.item()


def uninterrupted_final(steps: int, world: int) -> torch.nn.Module:
    """The model an uninterrupted run of the same steps ends with (gradients averaged as DDP does)."""
    net, opt = build()
    for step in range(steps):
        grads = []
        for rank in range(world):
            x, y = batch(step, rank)
            net.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            grads.append([p.grad.clone() for p in net.parameters()])
        for p, *gs in zip(net.parameters(), *grads, strict=True):
            p.grad = torch.stack(gs).mean(0)
        opt.step()
    return net


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "mpckpt-heal-example"))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--kill-at", type=int, default=12)
    p.add_argument("--storage-every", type=int, default=10)
    args = p.parse_args()

    mpckpt.init_process_group("gloo")  # heal forms the group again the same way
    rank, world = dist.get_rank(), dist.get_world_size()
    net, opt = build()
    model = DDP(net)

    def rewrap() -> None:  # what holds the failed group, made again on the new one
        nonlocal model
        model = DDP(net)

    with mpckpt.Checkpointer(args.root, keep_last=2) as ckpt:
        state = {"model": net, "optim": opt}
        last = ckpt.restore(state)
        if last is not None:
            print(f"[rank {rank} pid {os.getpid()}] restored step {last} from {ckpt.last_restore.source}", flush=True)
        step = 0 if last is None else last + 1
        while step < args.steps:
            try:
                train_step(model, opt, step, rank, args.kill_at)
                due = step % args.storage_every == args.storage_every - 1
                ckpt.save(step, state, mode="async" if due else "memory")  # every step to memory
                step += 1
            except Exception as error:
                started = time.perf_counter()
                last = mpckpt.heal(ckpt, state, error, rebuild=rewrap)  # raises again what is not a lost rank
                h = healing.history[-1]
                print(f"[rank {rank} pid {os.getpid()}] healed in place in {time.perf_counter() - started:.2f} s: "
                      f"rank(s) {h.lost} lost, back to step {last} from {h.source}", flush=True)
                step = 0 if last is None else last + 1
        ckpt.wait()
    if rank == 0:
        expected = uninterrupted_final(args.steps, world)
        same = all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), expected.state_dict().values(), strict=True))
        print(f"[rank 0] the final model is {'bit for bit' if same else 'NOT'} the uninterrupted run's", flush=True)
        if not same:
            raise SystemExit(1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
