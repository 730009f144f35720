"""One rank of ``test_full_disk``'s job, under torchrun: ``full_disk_job.py ROOT OUT``. ``ROOT`` is on a
filesystem the test filled: every upload fails with ``StorageFullError``.

Each rank opens ``ROOT`` with ``preemption=True`` (every ``save`` then agrees on the signal in a small
collective), keeps step 0 in memory and saves step 1 ASYNC (its upload fails). Rank 1 looks at that
failure (``result()``: it is then seen, never raised again); rank 0 only waits until it is there, so
that its next ``save`` raises it. Both save steps 2 to 4 in memory, catching what each raises, as a
training loop does. Then one all_reduce (a collective of the training's own: it pairs up right only
if every rank ran the same collectives before it) and the close. Writes ``OUT/rank<r>.json``: what
each save raised (``saves``), the all_reduce's sum.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import mpckpt
from mpckpt.errors import MpckptError, RankError

TIMEOUT_S = 30


def main() -> None:
    root, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
    rank = dist.get_rank()
    state = {"w": mpckpt.PerRank(torch.full((1 << 16,), float(rank)))}
    saves: dict[int, str] = {}
    ckpt = mpckpt.Checkpointer(root, preemption=True, keep_in_memory=True, workers=1, memory_budget="32MiB",
                               timeout_s=TIMEOUT_S)
    ckpt.save(0, state, mode="memory")
    failing = ckpt.save(1, state)
    if rank == 0:  # not looked at: its next save raises it
        deadline = time.monotonic() + TIMEOUT_S
        while not failing.done() and time.monotonic() < deadline:
            time.sleep(0.01)
    else:
        try:
            failing.result(TIMEOUT_S)
        except MpckptError as e:
            saves[1] = f"{type(e).__name__}: {e}"
    for step in (2, 3, 4):
        try:
            ckpt.save(step, state, mode="memory")
            saves[step] = "saved"
        except MpckptError as e:
            ranks = f" {e.ranks}" if isinstance(e, RankError) else ""
            saves[step] = f"{type(e).__name__}{ranks}: {e}"
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    try:
        ckpt.close()
    except MpckptError as e:
        saves[-1] = f"{type(e).__name__}: {e}"
    tmp = out / f"rank{rank}.tmp"
    tmp.write_text(json.dumps({"saves": saves, "sum": total.item()}))
    os.replace(tmp, out / f"rank{rank}.json")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
