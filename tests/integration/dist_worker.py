"""One rank of a multi-rank job for ``test_distributed``: run under torchrun (or as a plain process with
RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set) as ``dist_worker.py SCENARIO ROOT OUT [options]``.

Every rank opens the checkpoint root ``ROOT`` (storage options, if any, as JSON in the environment
variable ``DIST_WORKER_STORAGE_OPTIONS``, so that credentials stay off the command line) and writes
what it saw into the folder ``OUT``, which the test reads afterwards:

``train``     FSDP2 (``--ddp``: DistributedDataParallel) training with AdamW and a ``PerRank(RNGState())``;
              restores the latest checkpoint first (a restarted job goes on from it) and saves every step.
              Rank 0 dumps the full tensors after each save (``full-<step>.pt``); every rank writes its view
              (``view-a<attempt>-r<rank>.json``) and, after the last save, what ``torch.rand(3)`` draws
              (``draw-r<rank>.pt``). ``--crash-at K``: rank 1 SIGKILLs itself right after ``save(K)`` on a
              torchrun job's first attempt (a restarted attempt does not crash). ``--memory-after K``: the
              steps after K but the last are saved with ``mode="memory"`` (kept in memory, never uploaded).
``restore``   a fresh model (other initial weights) and an optimizer without state restore the latest
              checkpoint, saved by ``--saved-world`` ranks: at another world size ``restore(strict=True)``
              must raise a StateError (its message goes to the view), then ``strict=False`` restores. Rank 0
              dumps the restored tensors (``restored.pt``); every rank draws (``draw-r<rank>.pt``); then one
              more training step is saved and dumped (``full-<step>.pt``). ``--fallback``: restore with
              ``fallback=True`` and stop there.
``kill``      saves step 1 and waits; at step 2 rank 1 SIGKILLs itself right after ``save``, rank 0 waits
              and records the error (``kill-r0.json``).
``mismatch``  the ranks save states that differ (one root per case: ``ROOT/<case>``); each rank records the
              error (``mismatch-<case>-r<rank>.json``).

Training data is drawn per step and rank from a generator seeded with both, so a run resumed from
any committed step computes what an uninterrupted one does.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import mpckpt
from harness.job import (
    attempt,
    build_model,
    draw,
    full_state,
    init_group,
    module_of,
    seed_generators,
    train_step,
    write_json,
)
from mpckpt.errors import MpckptError, StateError


def checkpointer(root: str, **options: Any) -> mpckpt.Checkpointer:
    storage = json.loads(os.environ.get("DIST_WORKER_STORAGE_OPTIONS") or "{}")
    return mpckpt.Checkpointer(root, storage_options=storage or None, timeout_s=options.pop("timeout_s", 60),
                               **options)


def train(args: argparse.Namespace, rank: int, world: int, out: Path) -> None:
    model, opt = build_model(args.model, 0, world)
    seed_generators(100 + rank)  # they differ per rank: PerRank must give each its own back
    state = {"model": module_of(model), "optim": opt, "rng": mpckpt.PerRank(mpckpt.RNGState())}
    with checkpointer(args.root, overlap=args.overlap) as ckpt:
        resumed = ckpt.restore(state)
        start = 0 if resumed is None else resumed + 1
        for step in range(start, args.steps):
            train_step(model, opt, step, rank)
            memory = args.memory_after is not None and args.memory_after < step < args.steps - 1
            ckpt.save(step, state, mode="memory" if memory else "async")
            if args.crash_at == step and "TORCHELASTIC_RESTART_COUNT" in os.environ and attempt() == 0:
                if rank == 1:
                    os.kill(os.getpid(), signal.SIGKILL)
            dumped = full_state(model, opt)
            if rank == 0:
                torch.save(dumped, out / f"full-{step}.pt")
            if args.crash_at is not None and step == args.crash_at - 1:
                ckpt.wait()  # the step before the crash is surely committed
        ckpt.wait()
        draw(out / f"draw-r{rank}.pt")  # the first draws after the last save: what restoring it gives back
        write_json(out / f"view-a{attempt()}-r{rank}.json",
                   {"resumed": resumed, "latest": ckpt.latest_step, "steps": ckpt.steps(), "world": world,
                    "source": getattr(ckpt.last_restore, "source", None)})


def restore(args: argparse.Namespace, rank: int, world: int, out: Path) -> None:
    model, opt = build_model(args.model, 1, world)  # other weights than the saved ones, no optimizer state
    seed_generators(200 + rank)
    state = {"model": module_of(model), "optim": opt, "rng": mpckpt.PerRank(mpckpt.RNGState())}
    view: dict[str, Any] = {"world": world}
    with checkpointer(args.root) as ckpt:
        if args.saved_world != world:
            try:
                ckpt.restore(state, strict=True)
                view["strict_error"] = None
            except StateError as e:
                view["strict_error"] = {"key": e.key, "message": str(e)}
            restored = ckpt.restore(state, strict=False)
        else:
            restored = ckpt.restore(state, fallback=args.fallback)
        draw(out / f"draw-r{rank}.pt")
        dumped = full_state(model, opt)
        if rank == 0:
            torch.save(dumped, out / "restored.pt")
        view.update(restored=restored, restored_bytes=ckpt.stats.restored_bytes)
        if args.fallback:  # the damaged newer step keeps its number: nothing more is saved
            write_json(out / f"view-r{rank}.json", view)
            return
        step = restored + 1
        train_step(model, opt, step, rank)
        ckpt.save(step, state)
        dumped = full_state(model, opt)
        if rank == 0:
            torch.save(dumped, out / f"full-{step}.pt")
        ckpt.wait()
        view.update(latest=ckpt.latest_step, steps=ckpt.steps())
    write_json(out / f"view-r{rank}.json", view)


def kill(args: argparse.Namespace, rank: int, world: int, out: Path) -> None:
    model, opt = build_model("fsdp", 0, world)
    state = {"model": model, "optim": opt, "rng": mpckpt.PerRank(mpckpt.RNGState())}
    ckpt = checkpointer(args.root, timeout_s=args.timeout_s)
    train_step(model, opt, 1, rank)
    ckpt.save(1, state)
    ckpt.wait()
    train_step(model, opt, 2, rank)
    ckpt.save(2, state)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # mid-checkpoint: its files are not durable, its part never posted
    started = time.monotonic()
    doc: dict[str, Any] = {"error": None}
    try:
        ckpt.wait()  # its default bound outlasts the commit protocol's: the RankError, not a WaitTimeoutError
    except MpckptError as e:
        doc["error"] = {"type": type(e).__name__, "ranks": getattr(e, "ranks", None), "step": getattr(e, "step", None),
                        "message": str(e)}
    doc.update(elapsed=time.monotonic() - started, latest=ckpt.latest_step)
    write_json(out / f"kill-r{rank}.json", doc)
    try:
        ckpt.close()
    except MpckptError as e:  # the failed step may be reported again
        write_json(out / f"kill-close-r{rank}.json", {"type": type(e).__name__, "message": str(e)})
    os._exit(0)  # the group has a dead member: tearing it down could wait on it


MISMATCHES = ("extra-key", "extra-value", "shape")


def mismatch(args: argparse.Namespace, rank: int, world: int, out: Path) -> None:
    """Each case saves into a root of its own, ``ROOT/<case>``."""
    model, opt = build_model("fsdp", 0, world)
    train_step(model, opt, 0, rank)
    for case in MISMATCHES:
        state: dict[str, Any] = {"model": model, "optim": opt}
        if case == "extra-key" and rank == 1:
            state["extra"] = torch.zeros(4)  # not wrapped in PerRank: every rank must have it
        elif case == "extra-value" and rank == 1:
            state["epoch"] = 3  # a plain value only rank 1 has
        elif case == "shape":
            state["counter"] = torch.zeros(2 + rank)
        doc: dict[str, Any] = {"error": None}
        with checkpointer(f"{args.root}/{case}") as ckpt:
            try:
                ckpt.save(0, state)
                ckpt.wait()
            except StateError as e:
                doc["error"] = {"type": type(e).__name__, "key": e.key, "message": str(e)}
            doc["latest"] = ckpt.latest_step
        write_json(out / f"mismatch-{case}-r{rank}.json", doc)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["train", "restore", "kill", "mismatch"])
    parser.add_argument("root")
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", choices=["fsdp", "ddp"], default="fsdp")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--overlap", action="store_true")
    parser.add_argument("--fallback", action="store_true")
    parser.add_argument("--crash-at", type=int)
    parser.add_argument("--memory-after", type=int)
    parser.add_argument("--saved-world", type=int)
    parser.add_argument("--timeout-s", type=float, default=10.0)
    args = parser.parse_args()
    rank, world = init_group()
    args.out.mkdir(parents=True, exist_ok=True)
    {"train": train, "restore": restore, "kill": kill, "mismatch": mismatch}[args.scenario](args, rank, world, args.out)
    if attempt() == 0:  # after a torchrun restart tearing the group down may abort (torch 2.13)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
