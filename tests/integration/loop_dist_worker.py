"""One rank of the multi-rank ``LoopState`` test: ``python -m torch.distributed.run --nproc-per-node=2
loop_dist_worker.py ROOT OUT``.

Every rank saves a ``LoopState`` that is the same on every rank (replicated) and one of its own
under ``PerRank`` (a hidden state and a running loss that differ per rank), changes both, restores,
and writes what it got back to ``OUT/r<rank>.json``.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import mpckpt


def main() -> None:
    root, out = sys.argv[1], Path(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    loop = mpckpt.LoopState(lr=5.0, best_val=1.5, epoch=2)
    own = mpckpt.LoopState(hidden=(torch.full((2, 3), float(rank)), torch.full((2, 3), -float(rank))),
                           total_loss=10.0 + rank)
    state = {"loop": loop, "own": mpckpt.PerRank(own)}
    with mpckpt.Checkpointer(root, workers=1, timeout_s=60) as ckpt:
        ckpt.save(0, state, mode="sync")
        loop.lr, loop.epoch = 0.0, 0
        own.hidden, own.total_loss = (torch.zeros(2, 3), torch.zeros(2, 3)), 0.0
        restored = ckpt.restore(state)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"r{rank}.json").write_text(json.dumps({
        "restored": restored, "lr": loop.lr, "epoch": loop.epoch, "total_loss": own.total_loss,
        "hidden": [h.tolist() for h in own.hidden],
    }))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
