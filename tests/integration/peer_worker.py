"""One rank of ``test_peer_copies``'s jobs, under torchrun on a simulated node (``harness.nodes``):
``peer_worker.py SCENARIO ROOT OUT [options]``. Every rank opens ``ROOT`` with ``keep_in_memory=True``
and ``peer_copies=--copies`` and writes what it saw into the folder ``OUT``, which the test reads.

The state: a small model (``--model``: DDP or FSDP2 with ``fully_shard`` on a CPU mesh) with AdamW,
a ``PerRank(RNGState())`` and, with ``--blob-mb``, a ``PerRank`` tensor of that many MiB (per rank:
``--blob-mb-rank R=MB``; its bytes differ per rank and step). What a rank holds of it ("local": its
FSDP2 shards, DDP's full tensors, its torch generator state and its blob) is what the test compares.

``train``    trains ``--steps`` steps and saves each: ``async`` (``--overlap``: overlapped), or
             ``mode="memory"`` from step ``--memory-from`` on; waits on each save's future and then
             ``ckpt.wait()`` (the copies to the other node are then in place; ``--no-wait``: goes on at
             once, as a training loop does) and dumps its local state right before each save
             (``saved-<step>-r<rank>.pt``, whole or absent). Then writes ``train-r<rank>.json`` (every save's
             stats) and waits, never closing the checkpointer: the test loses a node and kills the job,
             as a crash would (what is kept in memory stays there).
``restore``  a fresh model (other initial weights), an optimizer without state, other generators and a
             zeroed blob restore (``ckpt.restore(state)``); writes ``restored-r<rank>.pt`` (its local state)
             and ``restored-r<rank>.json`` (step, ``last_restore.source``, seconds to open and to restore),
             then closes.
``inflight`` step 0 saved to storage and waited for (copies included), then step 1 with
             ``mode="memory"``: rank 0 writes ``started-r0`` just before its save and waits on the future
             (the test loses rank 0's partner meanwhile), then writes ``inflight-r0.json`` (whether the
             future resolved, its ``peer_copies``, how long it took); every rank then waits to be killed.

``diverge`` on a root whose filesystem is full (every upload fails): step 0 uploaded; rank 1 looks at
             each save's outcome, rank 0 does not (it waits until step 0 has failed), so rank 0's save of
             step 1 (uploaded) raises that failure instead of saving and rank 1's takes it: from then
             on the ranks' save sequence numbers differ by one. Then step 2 in memory and step 3
             uploaded (dumped before each save), ``ckpt.wait()`` (the outcomes, then the copies), and
             ``train-r<rank>.json`` (step -> ``status copies``, or what the save or the wait raised);
             then it waits to be killed, as ``train`` does.

``--budget``: ``memory_budget`` (``--budget-rank R=B``: rank R's). Training data is drawn per step and
rank from a generator seeded with both.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import mpckpt
from harness.job import init_group, module_of, parallel, seed_generators, write_json

IN, OUT_DIM = 16, 4
MiB = 1 << 20


def build_model(kind: str, seed: int, world: int, width: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(IN, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                                torch.nn.ReLU(), torch.nn.Linear(width, OUT_DIM))
    return parallel(model, kind, world)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(8, IN, generator=g), torch.randn(8, OUT_DIM, generator=g)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()


def local(value: Any) -> Any:
    """What this rank holds of ``value``: a DTensor's local shard, a copy of a plain tensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.to_local().detach().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return value


def local_state(model: torch.nn.Module, opt: torch.optim.Optimizer, blob: torch.Tensor | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": {k: local(v) for k, v in module_of(model).state_dict().items()},
        "optim": {i: {k: local(v) for k, v in s.items()} for i, s in opt.state_dict()["state"].items()},
        "rng": torch.get_rng_state(),
    }
    if blob is not None:
        out["blob"] = blob.clone()
    return out


def per_rank(default: Any, overrides: list[str], rank: int) -> Any:
    for item in overrides:
        r, _, value = item.partition("=")
        if int(r) == rank:
            return value
    return default


class Job:
    """This rank's model, optimizer, blob, state and checkpointer."""

    def __init__(self, args: argparse.Namespace, rank: int, world: int, *, fresh: bool) -> None:
        self.args, self.rank, self.world = args, rank, world
        self.model, self.opt = build_model(args.model, 1 if fresh else 0, world, args.width)
        seed_generators((200 if fresh else 100) + rank)
        mb = float(per_rank(args.blob_mb, args.blob_mb_rank, rank))
        self.blob = None
        if mb:
            n = int(mb * MiB) // 4
            self.blob = torch.zeros(n) if fresh else torch.randn(n, generator=torch.Generator().manual_seed(rank))
        self.state: dict[str, Any] = {"model": module_of(self.model), "optim": self.opt,
                                      "rng": mpckpt.PerRank(mpckpt.RNGState())}
        if self.blob is not None:
            self.state["blob"] = mpckpt.PerRank(self.blob)
        self.ckpt = mpckpt.Checkpointer(args.root, memory_budget=per_rank(args.budget, args.budget_rank, rank),
                                        keep_in_memory=True, peer_copies=args.copies, overlap=args.overlap,
                                        workers=1, timeout_s=args.timeout_s)

    def step(self, step: int) -> None:
        train_step(self.model, self.opt, step, self.rank)
        if self.blob is not None:
            self.blob[step % 1024::1024] += 1.0  # every step's blob differs

    def save(self, step: int, mode: str) -> dict[str, Any]:
        future = self.ckpt.save(step, self.state, mode=mode)
        if self.args.no_wait:  # as a training loop does: on at once, the copies trail behind
            return {"step": step, "mode": mode}
        future.result(timeout=120)
        self.ckpt.wait(120)  # an async save's future resolves at its commit: its copies are waited for here
        return {"step": step, "mode": mode, "status": future.stats.status, "peer_copies": future.stats.peer_copies}

    def dump(self, name: str) -> None:
        path = self.args.out / f"{name}-r{self.rank}.pt"
        torch.save(local_state(self.model, self.opt, self.blob), path.with_suffix(".tmp"))
        os.replace(path.with_suffix(".tmp"), path)  # whole or absent, whenever a kill comes


def linger() -> None:
    """Wait to be killed (a crash leaves what is kept in memory where it is)."""
    while True:
        time.sleep(1)  # until the test kills it


def train(args: argparse.Namespace, rank: int, world: int) -> None:
    job = Job(args, rank, world, fresh=False)
    saves = []
    for step in range(args.steps):
        job.step(step)
        memory = args.memory_from is not None and step >= args.memory_from
        job.dump(f"saved-{step}")  # first: a kill right after the save finds what it saved
        saves.append(job.save(step, "memory" if memory else "async"))
    write_json(args.out / f"train-r{rank}.json", {"saves": saves, "shm": sorted(os.listdir("/dev/shm"))})
    linger()


def restore(args: argparse.Namespace, rank: int, world: int) -> None:
    started = time.monotonic()
    job = Job(args, rank, world, fresh=True)
    opened = time.monotonic()
    step = job.ckpt.restore(job.state)
    restored = time.monotonic()
    last = job.ckpt.last_restore
    job.dump("restored")
    write_json(args.out / f"restored-r{rank}.json", {"step": step, "source": None if last is None else last.source,
                                                      "open_s": opened - started, "restore_s": restored - opened})
    job.ckpt.close()
    print(f"rank {rank}: opened in {opened - started:.2f} s, restored in {restored - opened:.2f} s, closed in "
          f"{time.monotonic() - restored:.2f} s", flush=True)


def inflight(args: argparse.Namespace, rank: int, world: int) -> None:
    job = Job(args, rank, world, fresh=False)
    job.step(0)
    first = job.save(0, "async")
    job.dump("saved-0")
    job.step(1)
    job.dump("saved-1")
    dist.barrier()  # both ranks' copies of step 0 are in place
    if rank != 0:
        job.ckpt.save(1, job.state, mode="memory")
        linger()
    (args.out / "started-r0").write_text("")
    started = time.monotonic()
    future = job.ckpt.save(1, job.state, mode="memory")
    doc: dict[str, Any] = {"first": first, "resolved": False}
    try:
        future.result(timeout=args.wait_s)
        doc.update(resolved=True, status=future.stats.status, peer_copies=future.stats.peer_copies)
    except Exception as e:
        doc["error"] = f"{type(e).__name__}: {e}"
    doc["seconds"] = time.monotonic() - started
    write_json(args.out / "inflight-r0.json", doc)
    linger()


def diverge(args: argparse.Namespace, rank: int, world: int) -> None:
    job = Job(args, rank, world, fresh=False)
    saves: dict[int, str] = {}
    job.step(0)
    job.dump("saved-0")
    first = job.ckpt.save(0, job.state)
    try:
        if rank == 0:  # not looked at: its next save raises it
            deadline = time.monotonic() + args.wait_s
            while not first.done() and time.monotonic() < deadline:
                time.sleep(0.01)
        else:
            first.result(timeout=args.wait_s)
    except mpckpt.errors.MpckptError as e:
        saves[0] = f"{type(e).__name__}: {e}"
    dist.barrier()
    futures = {}
    for step, mode in ((1, "async"), (2, "memory"), (3, "async")):
        job.step(step)
        job.dump(f"saved-{step}")
        try:
            futures[step] = job.ckpt.save(step, job.state, mode=mode)
            if rank == 1:
                futures[step].result(timeout=args.wait_s)
        except mpckpt.errors.MpckptError as e:
            saves[step] = f"raised {type(e).__name__}: {e}"
    try:
        job.ckpt.wait(args.wait_s)
    except mpckpt.errors.MpckptError as e:
        saves[-1] = f"{type(e).__name__}: {e}"
    saves.update({step: f"{f.stats.status} {f.stats.peer_copies}" for step, f in futures.items()})
    write_json(args.out / f"train-r{rank}.json", {"saves": saves})
    linger()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["train", "restore", "inflight", "diverge"])
    parser.add_argument("root")
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", choices=["fsdp", "ddp"], default="fsdp")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--memory-from", type=int)
    parser.add_argument("--overlap", action="store_true")
    parser.add_argument("--copies", type=int, default=1)
    parser.add_argument("--no-wait", action="store_true")
    parser.add_argument("--blob-mb", type=float, default=0)
    parser.add_argument("--blob-mb-rank", action="append", default=[])
    parser.add_argument("--budget", default="256MiB")
    parser.add_argument("--budget-rank", action="append", default=[])
    parser.add_argument("--wait-s", type=float, default=120)
    parser.add_argument("--timeout-s", type=float, default=60)
    args = parser.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hang's stacks on demand, into the log
    rank, world = init_group()
    args.out.mkdir(parents=True, exist_ok=True)
    {"train": train, "restore": restore, "inflight": inflight, "diverge": diverge}[args.scenario](args, rank, world)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
