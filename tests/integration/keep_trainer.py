"""A small trainer for the tests of snapshots kept in memory: it restores, trains, saves, and may kill itself.

    python keep_trainer.py ROOT OUT --steps N [--mode async|sync|memory] [--kill-after S]
                           [--overlap] [--storage-every K] [--gate PATH] [--budget B]

Each step is one deterministic optimizer step (the data depends only on the step), then
``save(step, state, mode=...)`` (with ``--storage-every K`` only every K-th step goes to storage,
the others are ``mode="memory"``); the state it saves is written to ``OUT/state-<step>.pt`` first.
``--kill-after S``: SIGKILL itself right after the save of step S returned (with ``--overlap``,
while that snapshot is still being copied in the background). At start it restores and writes
``OUT/restored.json`` (step, source, bytes) and ``OUT/restored.pt`` (the state right after the
restore). ``--gate PATH``: storage is the gated local backend of the tests (uploads wait for PATH).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import mpckpt  # noqa: E402


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "optim": {k: {n: (t.clone() if isinstance(t, torch.Tensor) else t) for n, t in v.items()}
                      for k, v in opt.state_dict()["state"].items()}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("out")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--mode", default="async")
    p.add_argument("--kill-after", type=int, default=None)
    p.add_argument("--overlap", action="store_true")
    p.add_argument("--storage-every", type=int, default=0)
    p.add_argument("--gate", default=None)
    p.add_argument("--budget", default="64MiB")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 96), torch.nn.ReLU(), torch.nn.Linear(96, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    state = {"model": model, "optim": opt}
    root, options = args.root, None
    if args.gate:
        import tests.integration.gated_backend  # noqa: F401  (registers gated://)
        root, options = f"gated://{args.root}", {"gate": args.gate}
    ckpt = mpckpt.Checkpointer(root, memory_budget=args.budget, overlap=args.overlap, storage_options=options)
    step = ckpt.restore(state)
    last = ckpt.last_restore
    (out / "restored.json").write_text(json.dumps(
        {"step": step, "source": None if last is None else last.source, "bytes": None if last is None else last.bytes}))
    torch.save(snapshot(model, opt), out / "restored.pt")
    for s in range(0 if step is None else step + 1, args.steps):
        g = torch.Generator().manual_seed(s)
        loss = model(torch.randn(16, 96, generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        mode = args.mode
        if args.storage_every:
            mode = "async" if s % args.storage_every == 0 else "memory"
        torch.save(snapshot(model, opt), out / f"state-{s}.pt")  # what the save below holds
        ckpt.save(s, state, mode=mode)
        if s == args.kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
    ckpt.close()


if __name__ == "__main__":
    main()
