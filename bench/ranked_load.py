"""Reading a job's checkpoint in one process: ``mpckpt.load`` through the ranked reader, wall and CPU time.

A job of ``--save-ranks`` FSDP2 ranks (torchrun, gloo, CPU; ``--layers`` ``nn.Linear(--hidden,
--hidden)``, each and the root ``fully_shard``-ed, AdamW after one step) saves one checkpoint
once; then each repetition is a fresh process that calls ``mpckpt.load(root)`` ``--loads`` times
(every rank's chunks joined into full tensors, every 256 KiB block checked against its checksum)
and reports the fastest load's wall time and the CPU time (user + system, ``getrusage``) of the
loads. ``--pythonpath`` measures another checkout's mpckpt, interleaved with this one's. CPU time
says what a load costs even where other processes share the cores (wall time then does not).

    .venv/bin/python bench/ranked_load.py --layers 16 --reps 2 [--pythonpath /tmp/old]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

_SAVE = """
import sys, torch, torch.distributed as dist, mpckpt
from torch.distributed.fsdp import fully_shard
from torch.distributed.device_mesh import init_device_mesh
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(int(sys.argv[3]), int(sys.argv[3])) for _ in range(int(sys.argv[2]))])
for m in model:
    fully_shard(m, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.AdamW(model.parameters())
model(torch.randn(4, int(sys.argv[3]))).sum().backward()
opt.step()
with mpckpt.Checkpointer(sys.argv[1], keep_in_memory=False) as ckpt:
    ckpt.save(1, {"model": model, "optim": opt}, mode="sync")
dist.destroy_process_group()
"""


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def child(root: str, loads: int) -> None:
    import mpckpt

    walls, cpus = [], []
    for _ in range(loads):
        t, c = time.perf_counter(), _cpu_s()
        state = mpckpt.load(root)
        walls.append(time.perf_counter() - t)
        cpus.append(_cpu_s() - c)
        del state
    print(json.dumps({"wall_min_s": min(walls), "cpu_s": sorted(cpus)}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--save-ranks", type=int, default=2)
    p.add_argument("--reps", type=int, default=2, help="fresh processes per checkout")
    p.add_argument("--loads", type=int, default=3, help="loads per process")
    p.add_argument("--pythonpath", default=None, help="also measure the mpckpt of this checkout")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args.child, args.loads)
    with tempfile.TemporaryDirectory(prefix="mpckpt-ranked-load-") as tmp:
        root = os.path.join(tmp, "root")
        script = os.path.join(tmp, "save.py")
        with open(script, "w") as f:
            f.write(_SAVE)
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        subprocess.run([torchrun, "--standalone", "--nproc-per-node", str(args.save_ranks), script, root,
                        str(args.layers), str(args.hidden)], check=True, capture_output=True)
        checkouts = [("this", None)] + ([("other", args.pythonpath)] if args.pythonpath else [])
        for rep in range(args.reps):
            for label, path in checkouts:
                env = dict(os.environ, **({"PYTHONPATH": path} if path else {}))
                out = subprocess.run([sys.executable, __file__, "--child", root, "--loads", str(args.loads)],
                                     env=env, check=True, capture_output=True, text=True).stdout
                result = json.loads(out.strip().splitlines()[-1])
                print(f"{label:5} rep {rep}: fastest load {result['wall_min_s']:.3f} s wall, CPU per load "
                      + ", ".join(f"{c:.3f}" for c in result["cpu_s"]) + " s", flush=True)


if __name__ == "__main__":
    main()
