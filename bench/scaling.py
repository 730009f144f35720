"""How mpckpt's blocked time scales with the state: size sweep and many small tensors.

Two measurements, each size in a fresh subprocess:

1. Size sweep (``--sizes``, GiB of params + Adam moments): median blocked time of an
   ASYNC ``Checkpointer.save`` against the physical floor (a bare ``copy_`` of the same
   tensors into preallocated, pre-touched shared memory), then a least-squares slope in
   ms/GiB for each. mpckpt should grow with the floor's slope.
2. Small tensors (``--small-count`` tensors of ``--small-numel`` float32): mpckpt's blocked
   time minus the floor's, per tensor, in microseconds: the fixed cost mpckpt adds per tensor.

Floor copies and saves are interleaved rep by rep (the machine may be shared), and every
save is awaited before the next, so blocked time is measured without upload contention.
``--profile`` prints a cProfile of one extra save per case to stderr.

    .venv/bin/python bench/scaling.py --sizes 0.25,0.5,1,2,4
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import shutil
import sys
from typing import Any

import _harness as h
import torch

SWEEP_COLUMNS = [
    ("gib", "GiB", 2), ("tensors", "tensors", 0), ("floor_median_ms", "floor median ms", 1),
    ("mpckpt_median_ms", "mpckpt median ms", 1), ("mpckpt_first_ms", "mpckpt first ms", 1),
    ("ratio", "mpckpt / floor", 2), ("snapshot_median_ms", "of which copy (snapshot_ms)", 1),
    ("foreign_cpu_pct", "other procs CPU %", 0),
]


def measure(state: Any, tensors: list[torch.Tensor], folder: str, args: argparse.Namespace) -> dict[str, Any]:
    """Interleave ``reps`` floor copies and mpckpt saves of ``state``; return both series."""
    import mpckpt

    floor = h.ShmFloor(tensors)
    floor_ms, blocked_ms, snapshot_ms = [], [], []
    with mpckpt.Checkpointer(folder, workers=args.workers, keep_last=1) as ckpt:
        ckpt.prepare(state)
        for step in range(args.reps):
            floor_ms.append(floor.copy())
            future = ckpt.save(step, state)
            blocked_ms.append(future.stats.blocked_ms)
            snapshot_ms.append(future.stats.snapshot_ms)
            future.result()
        if args.profile:
            profile_save(ckpt, args.reps, state)
    return {
        "tensors": len(tensors), "bytes": h.state_bytes(tensors),
        "floor_ms": [round(x, 3) for x in floor_ms], "mpckpt_ms": [round(x, 3) for x in blocked_ms],
        "floor_median_ms": h.median(floor_ms), "mpckpt_median_ms": h.median(blocked_ms),
        "mpckpt_first_ms": blocked_ms[0], "snapshot_median_ms": h.median(snapshot_ms),
        "ratio": h.median(blocked_ms) / h.median(floor_ms),
    }


def profile_save(ckpt: Any, step: int, state: Any) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    future = ckpt.save(step, state)
    profiler.disable()
    future.result()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(20)
    sys.stderr.write(f"--- profile of one save ({future.stats.blocked_ms:.1f} ms blocked) ---\n{out.getvalue()}")


def run_size(args: argparse.Namespace) -> dict[str, Any]:
    if args.child == "small":
        state = {f"t{i:05d}": torch.randn(args.small_numel) for i in range(args.small_count)}
        result = measure(state, list(state.values()), args.dir, args)
        extra = (result["mpckpt_median_ms"] - result["floor_median_ms"]) * 1e3 / args.small_count
        return {"case": "small", **result, "extra_us_per_tensor": extra,
                "floor_us_per_tensor": result["floor_median_ms"] * 1e3 / args.small_count}
    gib = float(args.child)
    work = h.build_workload(gib)
    return {"case": "size", "gib": gib, **measure(work.state, h.state_tensors(work), args.dir, args)}


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    folder, remove = h.target_dir(args.dir, "scaling-")
    cases = [s.strip() for s in args.sizes.split(",") if s.strip()] + (["small"] if args.small_count else [])
    results = []
    try:
        for case in cases:
            print(f"[scaling] {case} ...", file=sys.stderr, flush=True)
            case_dir = os.path.join(folder, case)
            argv = [os.path.abspath(__file__), "--child", case, "--reps", str(args.reps), "--workers",
                    str(args.workers), "--small-count", str(args.small_count), "--small-numel",
                    str(args.small_numel), "--dir", case_dir] + (["--profile"] if args.profile else [])
            busy = h.wait_for_quiet(args.wait_quiet_s)
            results.append({"case": case, "busy_before_pct": busy, **h.run_child(argv, sample_ms=100)})
            shutil.rmtree(case_dir, ignore_errors=True)
    finally:
        if remove:
            shutil.rmtree(folder, ignore_errors=True)
    sizes = [r for r in results if r.get("case") == "size"]
    xs = [r["bytes"] / h.GIB for r in sizes]
    floor_slope, _ = h.fit_slope(xs, [r["floor_median_ms"] for r in sizes])
    mpckpt_slope, mpckpt_icpt = h.fit_slope(xs, [r["mpckpt_median_ms"] for r in sizes])
    return {"benchmark": "scaling", "args": vars(args), "machine": h.machine_info(),
            "floor_ms_per_gib": floor_slope, "mpckpt_ms_per_gib": mpckpt_slope, "mpckpt_intercept_ms": mpckpt_icpt,
            "slope_ratio": mpckpt_slope / floor_slope if floor_slope else None,
            "sizes": sizes, "small": next((r for r in results if r.get("case") == "small"), None),
            "errors": [r for r in results if "error" in r]}


def print_report(summary: dict[str, Any]) -> None:
    print(h.markdown_table(summary["sizes"], SWEEP_COLUMNS))
    print(f"\nslope: floor {h.fmt(summary['floor_ms_per_gib'])} ms/GiB, mpckpt {h.fmt(summary['mpckpt_ms_per_gib'])} "
          f"ms/GiB (ratio {h.fmt(summary['slope_ratio'], 2)})")
    small = summary["small"]
    if small and "extra_us_per_tensor" in small:
        print(f"\n{small['tensors']} small tensors: floor {small['floor_median_ms']:.1f} ms "
              f"({small['floor_us_per_tensor']:.2f} us/tensor), mpckpt {small['mpckpt_median_ms']:.1f} ms; "
              f"mpckpt adds {small['extra_us_per_tensor']:.2f} us per tensor")
    for err in summary["errors"]:
        print(f"error in case {err['case']}: {err['error']}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="0.25,0.5,1,2,4", help="comma list of GiB (params + Adam moments)")
    p.add_argument("--reps", type=int, default=5, help="saves per size")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--small-count", type=int, default=10_000, help="small tensors (0: skip that case)")
    p.add_argument("--small-numel", type=int, default=256, help="float32 elements per small tensor")
    p.add_argument("--out", default=os.path.join(h.RESULTS_DIR, "scaling.json"))
    p.add_argument("--dir", default=None, help="target folder (default: a temporary one under bench/results/)")
    p.add_argument("--profile", action="store_true", help="print a cProfile of one extra save per case")
    p.add_argument("--wait-quiet-s", type=float, default=60,
                   help="before each case, wait up to this long for other processes to leave the CPUs idle")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.child:
        os.makedirs(args.dir, exist_ok=True)
        h.emit_result(run_size(args))
        return
    summary = run_all(args)
    h.write_json(args.out, summary)
    print_report(summary)
    print(f"\nresults: {args.out}")


if __name__ == "__main__":
    main()
