"""What ``save()`` costs the training thread beyond the bare copy, and how it grows with tensors.

For each state shape (``--shapes``: tensor count x tensor size), in a fresh subprocess:

  floor    a bare ``copy_`` of every tensor into preallocated, pre-touched shared memory
  mpckpt   ``Checkpointer(dir, workers=2)``, ``prepare(state)`` first, then ``--saves`` ASYNC
           saves, each timed from the call to its return; the previous save's commit is waited
           for *outside* the timing, so no upload runs while a save is timed and what is
           measured is the save path itself (flatten, layout cache, ledger record, copy, jobs)

The overhead per tensor is (mpckpt median - floor median) / tensors. ``--python`` runs the
children with another interpreter and ``--pythonpath`` with another checkout (to compare two
commits in one run, alternating so that this machine's drift hits both alike):

    .venv/bin/python bench/save_overhead.py --repeats 3
    .venv/bin/python bench/save_overhead.py --pythonpath /tmp/before --label before --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
SHAPES = ["16x16MiB", "1000x256KiB", "10000x4KiB"]
UNITS = {"KiB": 1 << 10, "MiB": 1 << 20}


def parse_shape(shape: str) -> tuple[int, int]:
    count, size = shape.split("x")
    for unit, factor in UNITS.items():
        if size.endswith(unit):
            return int(count), int(size[: -len(unit)]) * factor
    return int(count), int(size)


def child(shape: str, saves: int) -> dict[str, Any]:
    import torch

    import mpckpt

    count, nbytes = parse_shape(shape)
    state = {f"layer{i}": torch.randn(nbytes // 4) for i in range(count)}
    tensors = list(state.values())
    total = sum(t.numel() * 4 for t in tensors)
    floor_buf = torch.empty(total // 4, dtype=torch.float32).share_memory_()
    floor_buf.zero_()
    views, offset = [], 0
    for t in tensors:
        views.append(floor_buf[offset:offset + t.numel()])
        offset += t.numel()
    floor = []
    for _ in range(saves):
        started = time.perf_counter()
        for dst, src in zip(views, tensors, strict=True):
            dst.copy_(src)
        floor.append((time.perf_counter() - started) * 1e3)
    del views, floor_buf
    blocked = []
    with tempfile.TemporaryDirectory(dir=os.path.join(BENCH_DIR, "results")) as root:
        with mpckpt.Checkpointer(os.path.join(root, "run"), workers=2, keep_last=1) as ckpt:
            ckpt.prepare(state)
            for step in range(saves):
                for t in tensors[:1]:
                    t.add_(1.0)
                started = time.perf_counter()
                future = ckpt.save(step, state)
                blocked.append((time.perf_counter() - started) * 1e3)
                future.result(600)  # not timed: the next save starts with nothing uploading
    return {"shape": shape, "tensors": count, "bytes": total, "mpckpt": mpckpt.__file__,
            "floor_ms": statistics.median(floor), "blocked_ms": statistics.median(blocked),
            "blocked_p90_ms": sorted(blocked)[int(0.9 * (len(blocked) - 1))],
            "overhead_us_per_tensor": (statistics.median(blocked) - statistics.median(floor)) * 1e3 / count}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma list of COUNTxSIZE, e.g. 1000x256KiB")
    p.add_argument("--saves", type=int, default=20)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--pythonpath", default=None, help="a checkout whose mpckpt the children import")
    p.add_argument("--label", default="this checkout")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.saves)))
        return
    os.makedirs(os.path.join(BENCH_DIR, "results"), exist_ok=True)
    env = dict(os.environ)
    if args.pythonpath:
        env["PYTHONPATH"] = os.path.abspath(args.pythonpath)
    rows = []
    for _ in range(args.repeats):
        for shape in args.shapes.split(","):
            out = subprocess.run([args.python, os.path.abspath(__file__), "--child", shape, "--saves", str(args.saves)],
                                 env=env, cwd=BENCH_DIR, capture_output=True, text=True, timeout=1800)
            if out.returncode != 0:
                raise SystemExit(f"child for {shape} failed:\n{out.stderr}")
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"| {args.label} | tensors | MiB | floor ms | save ms (p50) | save ms (p90) | overhead us/tensor |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['shape']} | {r['tensors']} | {r['bytes'] / (1 << 20):.0f} | {r['floor_ms']:.1f} | "
              f"{r['blocked_ms']:.1f} | {r['blocked_p90_ms']:.1f} | {r['overhead_us_per_tensor']:.1f} |")


if __name__ == "__main__":
    main()
