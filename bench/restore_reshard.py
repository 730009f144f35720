"""Resharding restore: bytes each rank reads, and the wall time, restoring an FSDP2 checkpoint at 1-4 ranks.

One FSDP2 state (``--layers`` ``nn.Linear(--hidden, --hidden)``, each layer and the root
``fully_shard``-ed on a CPU mesh, gloo; AdamW after one step: params + two moments, 403 MB
for 8 layers of 2048) is saved by ``--save-ranks`` ranks with ``mpckpt.Checkpointer``. Then
for each world size in ``--restore-ranks`` a fresh job builds the same model sharded over
its own ranks and a *fresh* AdamW (no state yet), opens the same root and calls
``ckpt.restore(state)``. Each rank reports:

- ``ckpt.stats.restored_bytes``: the bytes the restore read from storage (whole checksummed
  blocks, so a little more than the slices it needs), against its share, the checkpoint's
  bytes (every file of the step's folder) divided by the world size;
- the restore wall time (the ``restore`` call, which also makes the shared memory for later
  saves, as any restore does), the slowest rank's being the job's.

A check follows each restore: the full (unsharded) parameters and AdamW moments, gathered
with ``full_tensor()``, must equal those saved (compared by float64 sums per tensor).

The script launches every job itself with torchrun (``--standalone``, one job at a time);
the ranks write their figures as JSON into the root, which is removed at the end. Four
ranks on this 2-core machine only share the cores: the byte counts are exact, the times are
not those of four real hosts.

    .venv/bin/python bench/restore_reshard.py --layers 8 --save-ranks 2 --restore-ranks 1,2,3,4
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import _harness as h

COLUMNS = [
    ("ranks", "restore ranks", 0), ("rank", "rank", 0), ("restored_mib", "restored MiB", 1),
    ("share_mib", "share MiB (checkpoint / ranks)", 1), ("ratio", "restored / share", 3),
    ("restore_s", "restore s", 2), ("slowest_s", "job restore s (slowest rank)", 2), ("exact", "state equal", 0),
]


# -- the ranks (under torchrun) -----------------------------------------------------------------
def build(layers: int, hidden: int) -> tuple[Any, Any]:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    stack: list[nn.Module] = []
    for _ in range(layers):
        stack += [nn.Linear(hidden, hidden), nn.ReLU()]
    model = nn.Sequential(*stack)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def fingerprint(model: Any, opt: Any) -> dict[str, float]:
    """Float64 sum of every full parameter and AdamW moment (collectives: every rank calls it)."""
    import torch

    out = {}
    for name, p in model.named_parameters():
        out[name] = float(p.detach().full_tensor().double().sum())
        for key, value in opt.state.get(p, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                out[f"{name}/{key}"] = float(value.full_tensor().double().sum())
    return out


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    import mpckpt

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    model, opt = build(args.layers, args.hidden)
    state = {"model": model, "optim": opt}
    result: dict[str, Any] = {"rank": rank, "ranks": world}
    if args.child == "save":
        gen = torch.Generator().manual_seed(rank)
        x, y = torch.randn(16, args.hidden, generator=gen), torch.randn(16, args.hidden, generator=gen)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        with mpckpt.Checkpointer(args.root, workers=1) as ckpt:
            ckpt.save(1, state)
            ckpt.wait()
        saved = fingerprint(model, opt)
        if rank == 0:
            with open(os.path.join(args.root, "fingerprint.json"), "w") as f:
                json.dump(saved, f)
    else:
        with mpckpt.Checkpointer(args.root, workers=1) as ckpt:
            dist.barrier()
            t0 = time.perf_counter()
            step = ckpt.restore(state)
            result["restore_s"] = time.perf_counter() - t0
            result["step"] = step
            result["restored_bytes"] = ckpt.stats.restored_bytes
        got = fingerprint(model, opt)
        if rank == 0:
            with open(os.path.join(args.root, "fingerprint.json")) as f:
                want = json.load(f)
            result["exact"] = got.keys() == want.keys() and all(abs(got[k] - want[k]) <= 1e-9 * max(1.0, abs(want[k]))
                                                              for k in want)
    with open(os.path.join(args.root, f"result-{args.child}-{world}-{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


# -- the driver ------------------------------------------------------------------------------------
def launch(args: argparse.Namespace, phase: str, ranks: int) -> list[dict[str, Any]]:
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--standalone", f"--nproc-per-node={ranks}", os.path.abspath(__file__), "--child", phase,
           "--root", args.root, "--layers", str(args.layers), "--hidden", str(args.hidden)]
    subprocess.run(cmd, check=True, cwd=h.REPO_DIR)
    out = []
    for r in range(ranks):
        with open(os.path.join(args.root, f"result-{phase}-{ranks}-{r}.json")) as f:
            out.append(json.load(f))
    return out


def checkpoint_bytes(root: str) -> tuple[int, int]:
    """(all files of the step folder, the safetensors shard files alone)."""
    folder = next(os.path.join(root, n) for n in os.listdir(root) if n.startswith("step_"))
    total = h.folder_bytes(folder)
    shards = sum(os.path.getsize(os.path.join(d, n)) for d, _, files in os.walk(folder) for n in files
                 if n.endswith(".safetensors"))
    return total, shards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--save-ranks", type=int, default=2)
    parser.add_argument("--restore-ranks", default="1,2,3,4")
    parser.add_argument("--dir", default=None, help="root for the checkpoint (default: a temporary folder in /tmp)")
    parser.add_argument("--json", default=os.path.join(h.RESULTS_DIR, "restore_reshard.json"))
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--root", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        rank_main(args)
        return
    print("command: " + " ".join([os.path.relpath(sys.executable, h.REPO_DIR), *sys.argv]), flush=True)
    args.root = args.dir or tempfile.mkdtemp(prefix="mpckpt-reshard-")
    rows: list[dict[str, Any]] = []
    try:
        launch(args, "save", args.save_ranks)
        total, shards = checkpoint_bytes(args.root)
        print(f"saved at {args.save_ranks} ranks: {total / h.MIB:.1f} MiB in the step folder "
              f"({shards / h.MIB:.1f} MiB of safetensors shard files)", flush=True)
        for ranks in [int(x) for x in args.restore_ranks.split(",") if x.strip()]:
            got = launch(args, "restore", ranks)
            slowest = max(r["restore_s"] for r in got)
            for r in got:
                share = total / ranks
                rows.append({"ranks": ranks, "rank": r["rank"], "restored_mib": r["restored_bytes"] / h.MIB,
                             "share_mib": share / h.MIB, "ratio": r["restored_bytes"] / share,
                             "restore_s": r["restore_s"], "slowest_s": slowest if r["rank"] == 0 else None,
                             "exact": ("yes" if r["exact"] else "NO") if "exact" in r else None,
                             "restored_bytes": r["restored_bytes"], "step": r["step"]})
            print(f"restore at {ranks} ranks: slowest {slowest:.2f} s", flush=True)
    finally:
        if not args.dir:
            shutil.rmtree(args.root, ignore_errors=True)
    print()
    print(h.markdown_table(rows, COLUMNS))
    h.write_json(args.json, {"machine": h.machine_info(), "args": vars(args), "checkpoint_bytes": total,
                             "shard_bytes": shards, "rows": rows})


if __name__ == "__main__":
    main()
