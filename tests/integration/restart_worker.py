"""One rank of ``test_restarts``'s job: ``torchrun --max-restarts N restart_worker.py ROOT OUT LAST_ATTEMPT``.

Each attempt initializes its group with ``mpckpt.init_process_group("gloo")`` (a plain
``dist.init_process_group`` shares torchrun's agent store with the attempts before it), opens
``ROOT``, restores with the README's idiom (``0 if last is None else last + 1``), saves that one
step (ASYNC, waited for) and, before ``LAST_ATTEMPT``, rank 1 exits with status 3 so that torchrun
restarts every rank. Each attempt writes ``OUT/a<attempt>-r<rank>.json``: the step restored, where
from, the step saved, and the store prefix the group was made over.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

import mpckpt
from mpckpt.process_group import PREFIX, attempt_store_wanted


def main() -> None:
    root, out, last_attempt = sys.argv[1], sys.argv[2], int(sys.argv[3])
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    private = attempt_store_wanted({})
    mpckpt.init_process_group("gloo")
    rank = dist.get_rank()
    model = torch.nn.Linear(4, 4)
    state = {"model": model, "attempt": -1}
    with mpckpt.Checkpointer(root, workers=1, timeout_s=60) as ckpt:
        last = ckpt.restore(state)
        start = 0 if last is None else last + 1
        source = None if ckpt.last_restore is None else ckpt.last_restore.source
        with torch.no_grad():
            model.weight.fill_(float(start))
        state["attempt"] = attempt
        ckpt.save(start, state).result(timeout=60)
        with open(os.path.join(out, f"a{attempt}-r{rank}.json"), "w") as f:
            json.dump({"restored": last, "source": source, "saved": start, "restored_attempt": state["attempt"],
                       "prefix": PREFIX.format(attempt) if private else None}, f)
        dist.barrier()
    if attempt < last_attempt and rank == 1:
        os._exit(3)  # torchrun stops the other rank and restarts the job
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
