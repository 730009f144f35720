"""A trainer that counts the OpenMP threads of its process as mpckpt works: ``openmp_probe.py ROOT``.

The training thread runs a parallel torch op with 4 threads (a team of 3 workers however many
CPUs there are), then counts the process's threads that are not Python threads (the OpenMP
workers: no other native thread lives here), then opens a Checkpointer and goes through what a
run does (a restore on an empty root, which makes spare slabs; eager, overlapped, memory-only
and synchronous saves; a restore from memory and one from storage; a second Checkpointer), and
counts again after each. Prints one JSON object: ``{"before": n, "<moment>": n, ...}``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import torch

import mpckpt


def native_only_threads() -> int:
    """The threads of this process that are not Python threads: the fewest seen in 5 looks
    100 ms apart (a Python thread that just ended may still be leaving)."""
    counts = []
    for _ in range(5):
        python = {t.native_id for t in threading.enumerate()}
        counts.append(sum(1 for tid in os.listdir("/proc/self/task") if int(tid) not in python))
        time.sleep(0.1)  # the samples of a measurement (no event marks a thread's last moment)
    return min(counts)


def train(model: torch.nn.Module, big: torch.Tensor) -> None:
    """What a CPU training step does to the pools: parallel ops on the training thread."""
    model(torch.randn(64, 1024)).sum().backward()
    big.mul_(1.0001)


def main() -> None:
    root = sys.argv[1]
    torch.set_num_threads(4)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024))
    opt = torch.optim.AdamW(model.parameters())
    big = torch.randn(4 << 20)  # 16 MiB: every copy of it is a parallel op
    state = {"model": model, "optim": opt, "big": big}
    train(model, big)
    counts = {"before": native_only_threads()}
    with mpckpt.Checkpointer(root, workers=1, overlap=True) as ckpt:
        ckpt.restore(state)
        train(model, big)
        counts["restore_empty"] = native_only_threads()
        for step in range(4):
            train(model, big)
            opt.step()
            mode = ("async", "memory", "sync", "async")[step]
            ckpt.save(step, state, mode=mode, overlap=step % 2 == 0).result()
        train(model, big)
        counts["saves"] = native_only_threads()
        ckpt.restore(state)
        train(model, big)
        counts["restore"] = native_only_threads()
    train(model, big)
    counts["closed"] = native_only_threads()
    with mpckpt.Checkpointer(root, workers=1, keep_in_memory=False) as ckpt:
        ckpt.restore(state)  # from storage
        train(model, big)
        counts["restore_storage"] = native_only_threads()
    print(json.dumps(counts))


if __name__ == "__main__":
    main()
