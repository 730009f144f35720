"""One rank of ``test_job_memory_kills``'s jobs: ``torchrun --max-restarts 1 job_kill_worker.py ROOT OUT [options]``.

Every rank opens ``ROOT`` (``keep_in_memory`` on, the default), restores (``last + 1`` is where it
starts) and trains ``--steps`` deterministic steps of a small model (``--model``: DDP, or FSDP2
``fully_shard`` on a CPU mesh) with AdamW and a ``PerRank`` blob of ``--blob-mb`` MiB (its bytes
differ per rank and step; it makes each save's copy take a while). Each step's data depends only on
the step and the rank. Every step ends with ``save(step, state, mode="memory")``; every
``--storage-every``-th step is an ASYNC save to storage instead, waited for (so that storage's newest
step is known when a rank dies).

What it writes under ``OUT/rank<r>/`` for the test:

``trace``             (attempt 0; ``trace.a<n>`` on attempt n) a line ``saved <step>`` once ``save``
                      returned, ``started <step>`` before each step;
``state-<step>.pt``   this rank's local state (model, optimizer, blob digest) as saved at ``step``,
                      written before the save (``state-<step>.a<n>.pt`` on attempt n);
``restored-<n>.json`` on attempt n: the step ``restore`` returned and ``ckpt.last_restore``;
``restored-<n>.pt``   the local state right after that restore;
``final.pt``          the local state after the last step;
``kill.json``         (the killed rank) where it killed itself, just before the SIGKILL.

``--kill-rank R --kill-step S --moment M`` (attempt 0 only): rank R SIGKILLs itself at step S

``forward``       in the middle of the forward (a hook on the first layer), once every other rank's
                  trace says ``saved S - 1`` (bounded wait): the others block in S's gradient reduction;
``before_optim``  after S's backward, before its optimizer step, once every other rank's trace says
                  ``saved S`` (bounded wait): the others hold S, this rank only S - 1;
``in_save``       inside ``save(S)``, once every other rank saved S: a watcher thread started just before
                  the save SIGKILLs the process as soon as one of its threads is inside mpckpt's copy into
                  shared memory (``mpckpt/_stage/copier.py``; after ``--in-save-timeout-s`` without
                  seeing one, it kills all the same and says so in ``kill.json``);
``after_save``    right after ``save(S)`` returned, once every other rank saved S.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
import xxhash

import mpckpt
from harness.job import attempt, init_group, module_of, parallel, write_json
from tests.integration.peer_worker import local
from tests.waiting import poll_until

IN, WIDTH, OUT_DIM = 16, 64, 4
MiB = 1 << 20
MOMENTS = ("none", "forward", "before_optim", "in_save", "after_save")
OTHERS_SAVED_TIMEOUT_S = 60


def build(args: argparse.Namespace, world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(IN, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH),
                                torch.nn.ReLU(), torch.nn.Linear(WIDTH, OUT_DIM))
    return parallel(model, args.model, world)


def warm_up(model: torch.nn.Module) -> None:
    """One forward and backward that change no state, so that every step reduces DDP's gradients in the
    buckets DDP rebuilds after its first iteration. A job's first step reduces them in one bucket of every
    parameter, later steps in the rebuilt ones (in the order the gradients became ready): at 3 ranks
    another layout sums in another order, and a restarted job's first step would differ in the last bits
    from the uninterrupted run's step."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model(torch.zeros(1, IN)).sum().backward()
        model.zero_grad(set_to_none=True)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, IN, generator=g), torch.randn(8, OUT_DIM, generator=g)


def local_state(model: torch.nn.Module, opt: torch.optim.Optimizer, blob: torch.Tensor) -> dict[str, Any]:
    """This rank's model and optimizer tensors (cloned) and its blob's xxh3-128 (the blob itself is tens
    of MiB per step and rank: its digest stands for it)."""
    return {"model": {k: local(v) for k, v in module_of(model).state_dict().items()},
            "optim": {i: {k: local(v) for k, v in s.items()} for i, s in opt.state_dict()["state"].items()},
            "blob": xxhash.xxh3_128_hexdigest(blob.numpy().tobytes())}


class Files:
    """This rank's output folder."""

    def __init__(self, out: Path, rank: int, world: int) -> None:
        self.out, self.rank, self.world = out, rank, world
        self.dir = out / f"rank{rank}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.trace = self.dir / ("trace" if attempt() == 0 else f"trace.a{attempt()}")

    def note(self, line: str) -> None:
        with open(self.trace, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    def others_saved(self, step: int, timeout_s: float = OTHERS_SAVED_TIMEOUT_S) -> bool:
        """Wait (bounded) until every other rank's trace says ``saved <step>``; whether they all did."""
        others = [self.out / f"rank{r}" / "trace" for r in range(self.world) if r != self.rank]
        return bool(poll_until(lambda: all(p.exists() and f"saved {step}" in p.read_text().split("\n")
                                           for p in others), timeout_s))


def die(files: Files, moment: str, step: int, **doc: Any) -> None:
    write_json(files.dir / "kill.json", {"moment": moment, "step": step, **doc})
    os.kill(os.getpid(), signal.SIGKILL)


def in_copy() -> str | None:
    """The thread and function of a frame inside mpckpt's copy into shared memory, if any."""
    for ident, frame in sys._current_frames().items():
        f: FrameType | None = frame
        while f is not None:
            if f.f_code.co_filename.endswith(os.path.join("mpckpt", "_stage", "copier.py")):
                name = next((t.name for t in threading.enumerate() if t.ident == ident), str(ident))
                return f"{name}: {f.f_code.co_name}"
            f = f.f_back
    return None


def watcher(files: Files, step: int, others_saved: bool, timeout_s: float) -> threading.Thread:
    """A thread that SIGKILLs this process once one of its threads is copying (or after ``timeout_s``)."""

    def run() -> None:
        where = poll_until(in_copy, timeout_s, poll_s=0.0002)
        die(files, "in_save", step, others_saved=others_saved, mid_copy=where is not None, where=where)

    return threading.Thread(target=run, name="job-kill-watcher", daemon=True)


class Kill:
    """Where this rank SIGKILLs itself: at step ``step`` (-1: never), at ``moment``."""

    def __init__(self, args: argparse.Namespace, files: Files, rank: int) -> None:
        killing = attempt() == 0 and rank == args.kill_rank and args.moment != "none"
        self.files, self.moment = files, args.moment
        self.step = args.kill_step if killing else -1
        self.timeout_s = args.in_save_timeout_s
        self.current = -1  # the step being trained
        self.others_saved: bool | None = None

    def in_forward(self, model: torch.nn.Module) -> None:
        if self.step >= 0 and self.moment == "forward":
            first = next(m for m in module_of(model).modules() if isinstance(m, torch.nn.Linear))
            first.register_forward_hook(self._forward_hook)

    def _forward_hook(self, *_: Any) -> None:
        if self.current == self.step:  # once the others saved S - 1: the case's newest step held by all
            die(self.files, "forward", self.step, others_saved=self.files.others_saved(self.step - 1))

    def after_backward(self, step: int) -> None:
        if step == self.step and self.moment in ("before_optim", "in_save", "after_save"):
            self.others_saved = self.files.others_saved(step)
            if self.moment == "before_optim":
                die(self.files, "before_optim", step, others_saved=self.others_saved)

    def before_save(self, step: int) -> None:
        if step == self.step and self.moment == "in_save":
            watcher(self.files, step, bool(self.others_saved), self.timeout_s).start()

    def after_save(self, step: int) -> None:
        if step == self.step and self.moment == "after_save":
            die(self.files, "after_save", step, others_saved=self.others_saved)


def restore(ckpt: mpckpt.Checkpointer, state: dict[str, Any], files: Files, snapshot: Any) -> int:
    """Restore, write what was restored; the first step to train."""
    last = ckpt.restore(state)
    seen = ckpt.last_restore
    write_json(files.dir / f"restored-{attempt()}.json",
               {"step": last, "source": None if seen is None else seen.source,
                "bytes": None if seen is None else seen.bytes, "seconds": None if seen is None else seen.seconds})
    torch.save(snapshot(), files.dir / f"restored-{attempt()}.pt")
    return 0 if last is None else last + 1


def arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("out", type=Path)
    p.add_argument("--model", choices=["ddp", "fsdp"], default="ddp")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--storage-every", type=int, default=5)
    p.add_argument("--blob-mb", type=float, default=32)
    p.add_argument("--budget", default="256MiB")
    p.add_argument("--moment", choices=MOMENTS, default="none")
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--kill-step", type=int, default=7)
    p.add_argument("--in-save-timeout-s", type=float, default=5.0)
    return p.parse_args()


def main() -> None:
    args = arguments()
    rank, world = init_group()
    files = Files(args.out, rank, world)
    kill = Kill(args, files, rank)
    model, opt = build(args, world)
    warm_up(model)
    kill.in_forward(model)
    blob = torch.randn(int(args.blob_mb * MiB) // 4, generator=torch.Generator().manual_seed(rank))
    state = {"model": module_of(model), "optim": opt, "blob": mpckpt.PerRank(blob)}
    ckpt = mpckpt.Checkpointer(args.root, memory_budget=args.budget, workers=1, timeout_s=60)
    start = restore(ckpt, state, files, lambda: local_state(model, opt, blob))
    for step in range(start, args.steps):
        kill.current = step
        files.note(f"started {step}")
        x, y = batch(step, rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        kill.after_backward(step)
        opt.step()
        blob[step % 1024::1024] += 1.0
        name = f"state-{step}" if attempt() == 0 else f"state-{step}.a{attempt()}"
        torch.save(local_state(model, opt, blob), files.dir / f"{name}.pt")  # what save(step) holds
        storage = bool(args.storage_every) and step % args.storage_every == 0
        kill.before_save(step)
        future = ckpt.save(step, state, mode="async" if storage else "memory")
        if storage:
            future.result(timeout=120)  # storage's newest step is then known at any kill
        files.note(f"saved {step}")
        kill.after_save(step)
    torch.save(local_state(model, opt, blob), files.dir / "final.pt")
    ckpt.close()
    if attempt() == 0:  # after a torchrun restart tearing the group down may abort (torch 2.13)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
