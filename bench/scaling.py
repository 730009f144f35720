"""How mpckpt's blocked time scales with the state: size sweep and many small tensors.

Each case runs in a fresh subprocess:

1. Size sweep (``--sizes``, GiB of params + Adam moments): median blocked time of an
   ASYNC ``Checkpointer.save`` against the physical floor (a bare ``copy_`` of the same
   tensors into preallocated, pre-touched shared memory), then a least-squares slope in
   ms/GiB for each. mpckpt should grow with the floor's slope.
2. Small tensors (``--small-counts`` cases of that many float32 tensors of ``--small-numel``
   elements): mpckpt's blocked time minus the floor's, per tensor, in microseconds: the fixed
   cost mpckpt adds per tensor (goal: at most 2 us).

Every save is awaited (committed, retention done) before the next, outside the timing, so
blocked time is measured without upload contention. Where memory allows, floor copies and
saves are interleaved rep by rep (the machine may be shared). A case holds the state
(anonymous memory, with gradients), the floor buffer and mpckpt's slabs (both in /dev/shm);
each case is planned against MemAvailable and /dev/shm free space, keeping ``HEADROOM``
spare, in this order of preference:

  interleaved, 2 slabs   state + floor + two slabs (what ``prepare`` makes when the budget allows)
  interleaved, 1 slab    state + floor + one slab (``memory_budget`` just above one slab)
  floor first            all floor copies, the floor buffer freed, then the saves with one
                         slab: state + the larger of floor and slab ("interleaved": false)

A case that fits none of them (or whose checkpoints the target disk cannot hold twice) is
refused before anything runs. With 23 GiB usable, 8 GiB of state runs floor first: 11.2 GiB
of process (state, gradients, interpreter) + 8.2 GiB slab + uploaders + 2 GiB headroom = 21.6 GiB.
``--sequential`` runs every case floor first. ``--profile`` prints a cProfile of one extra save per case to stderr. The chart
(``--chart``, needs matplotlib) shows blocked time against size and the cost per tensor.

    .venv/bin/python bench/scaling.py --sizes 0.25,0.5,1,2,4,8 --small-counts 1000,10000,100000 --reps 5
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import pstats
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import _harness as h
import torch

HEADROOM = 2 * h.GIB        # memory left free at a case's peak
PROCESS_BYTES = h.GIB // 2  # a child's interpreter, torch, activations and allocator slack
UPLOADER_BYTES = 64 * h.MIB  # per uploader process and the fork server (measured: 10-55 MiB PSS)
SLAB_MARGIN = 64 * h.MIB    # memory_budget above the slabs it is meant to hold
DISK_MARGIN = h.GIB
SMALL_OBJECT_BYTES = 1024   # Python + torch objects of one small tensor (beyond its data)
HIDDEN = 2048               # h.build_workload's default width
GOAL_US_PER_TENSOR = 2.0

SWEEP_COLUMNS = [
    ("gib", "GiB", 2), ("tensors", "tensors", 0), ("interleaved", "interleaved", 0), ("slabs", "slabs", 0),
    ("floor_median_ms", "floor median ms", 1), ("mpckpt_median_ms", "mpckpt median ms", 1),
    ("mpckpt_first_ms", "mpckpt first ms", 1), ("ratio", "mpckpt / floor", 2),
    ("snapshot_median_ms", "of which copy (snapshot_ms)", 1), ("foreign_cpu_pct", "other procs CPU %", 0),
]
SMALL_COLUMNS = [
    ("tensors", "tensors", 0), ("interleaved", "interleaved", 0), ("floor_median_ms", "floor median ms", 2),
    ("mpckpt_median_ms", "mpckpt median ms", 2), ("floor_us_per_tensor", "floor us/tensor", 2),
    ("extra_us_per_tensor", "mpckpt adds us/tensor", 2), ("foreign_cpu_pct", "other procs CPU %", 0),
]


# -- planning: what a case holds and whether it fits -------------------------------------------
def slab_bytes(state_bytes: int) -> int:
    """One mpckpt slab for a state of ``state_bytes``, sized as ``Checkpointer.prepare`` sizes it."""
    need = int(state_bytes * 1.02) + (4 << 20)
    return -(-need // (2 << 20)) * (2 << 20)  # slabs come in 2 MiB steps


@dataclass(frozen=True)
class Footprint:
    """Bytes one case holds: ``state`` is what a checkpoint holds (and the floor buffer's size)."""

    state: int
    process: int  # the child's own memory: state, gradients, interpreter, objects

    @classmethod
    def of_case(cls, case: str, *, small_numel: int) -> Footprint:
        if case.startswith("small:"):
            count = int(case.split(":", 1)[1])
            state = count * small_numel * 4
            return cls(state, state + count * SMALL_OBJECT_BYTES + PROCESS_BYTES)
        params = h.layers_for(float(case), HIDDEN) * (HIDDEN * HIDDEN + HIDDEN) * 4
        return cls(3 * params, 4 * params + PROCESS_BYTES)  # params + 2 Adam moments; + gradients


@dataclass(frozen=True)
class Plan:
    """How a case runs: interleaved or floor first, how many slabs, under which budget."""

    interleaved: bool
    slabs: int
    budget_bytes: int
    shm_bytes: int  # floor + slabs at their peak (all of it in /dev/shm, none of it swappable)


def choose_plan(state: int, *, available: int, shm_free: int, workers: int, sequential: bool) -> Plan | None:
    """The most interleaved plan whose shared memory fits ``available`` (beyond the process) with headroom."""
    slab = slab_bytes(state)
    options = [(False, 1)] if sequential else [(True, 2), (True, 1), (False, 1)]
    for interleaved, slabs in options:
        shm = state + slabs * slab if interleaved else max(state, slabs * slab)
        if shm + (workers + 1) * UPLOADER_BYTES + HEADROOM <= available and shm + SLAB_MARGIN <= shm_free:
            return Plan(interleaved, slabs, slabs * slab + SLAB_MARGIN, shm)
    return None


def refusal(case: str, footprint: Footprint, *, workers: int, folder: str) -> str | None:
    """Why ``case`` cannot run on this machine now (None: it can)."""
    available, shm_free = h.memory_available_bytes(), h.shm_free_bytes()
    gib = h.GIB
    if choose_plan(footprint.state, available=available - footprint.process, shm_free=shm_free,
                   workers=workers, sequential=True) is None:
        least = (footprint.process + max(footprint.state, slab_bytes(footprint.state))
                 + (workers + 1) * UPLOADER_BYTES + HEADROOM)
        return (f"case {case} needs {least / gib:.1f} GiB of memory even floor first (state and gradients "
                f"{footprint.process / gib:.1f} + one slab {slab_bytes(footprint.state) / gib:.1f} + uploaders + "
                f"{HEADROOM / gib:.0f} headroom) but {available / gib:.1f} GiB is available and /dev/shm has "
                f"{shm_free / gib:.1f} GiB free; drop this size or free memory")
    disk_free = shutil.disk_usage(folder).free
    if disk_free < 2 * footprint.state + DISK_MARGIN:
        return (f"case {case} writes {footprint.state / gib:.1f} GiB per save and keeps up to two checkpoints; "
                f"{folder} has {disk_free / gib:.1f} GiB free; pass --dir on a larger disk")
    return None


def require_memory(nbytes: int, what: str) -> None:
    """Stop the case (not the machine) when ``nbytes`` no longer fits with half the headroom to spare.

    The plan kept the full headroom; this is the last check before each large allocation,
    for a shared machine where other processes may have taken memory since.
    """
    available, spare = h.memory_available_bytes(), HEADROOM // 2
    if nbytes + spare > available:
        raise MemoryError(f"{what} needs {nbytes / h.GIB:.2f} GiB + {spare / h.GIB:.0f} GiB spare, "
                          f"{available / h.GIB:.2f} GiB available now (other processes took memory?)")


# -- one case, in the child --------------------------------------------------------------------
def measure(state: Any, tensors: list[torch.Tensor], folder: str, plan: Plan,
            args: argparse.Namespace) -> dict[str, Any]:
    """``reps`` floor copies and mpckpt saves of ``state``, interleaved or floor first as ``plan`` says."""
    import mpckpt

    nbytes = h.state_bytes(tensors)
    require_memory(nbytes, "the floor buffer")
    floor = h.ShmFloor(tensors) if plan.interleaved else None
    floor_ms = [] if plan.interleaved else floor_first(tensors, args.reps)
    slabs = plan.slabs * slab_bytes(nbytes) + (args.workers + 1) * UPLOADER_BYTES
    require_memory(slabs, "mpckpt's slabs and uploaders")
    blocked_ms, snapshot_ms = [], []
    with mpckpt.Checkpointer(folder, workers=args.workers, keep_last=1, memory_budget=plan.budget_bytes) as ckpt:
        ckpt.prepare(state)
        for step in range(args.reps):
            if floor is not None:
                floor_ms.append(floor.copy())
            future = ckpt.save(step, state)
            blocked_ms.append(future.stats.blocked_ms)
            snapshot_ms.append(future.stats.snapshot_ms)
            future.result()
            ckpt.wait()  # retention has deleted the previous checkpoint: at most two on disk
        if args.profile:
            profile_save(ckpt, args.reps, state)
        peak_shm = ckpt.stats.peak_shm_bytes
    return {
        "tensors": len(tensors), "bytes": nbytes, **asdict(plan), "mpckpt_peak_shm_mib": round(peak_shm / h.MIB, 1),
        "floor_ms": [round(x, 3) for x in floor_ms], "mpckpt_ms": [round(x, 3) for x in blocked_ms],
        "floor_median_ms": h.median(floor_ms), "mpckpt_median_ms": h.median(blocked_ms),
        "mpckpt_first_ms": blocked_ms[0], "snapshot_median_ms": h.median(snapshot_ms),
        "ratio": h.median(blocked_ms) / h.median(floor_ms),
    }


def floor_first(tensors: list[torch.Tensor], reps: int) -> list[float]:
    """``reps`` floor copies into a buffer that is freed on return, before mpckpt makes its slab."""
    floor = h.ShmFloor(tensors)
    times = [floor.copy() for _ in range(reps)]
    del floor
    gc.collect()
    return times


def profile_save(ckpt: Any, step: int, state: Any) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    future = ckpt.save(step, state)
    profiler.disable()
    future.result()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(20)
    sys.stderr.write(f"--- profile of one save ({future.stats.blocked_ms:.1f} ms blocked) ---\n{out.getvalue()}")


def run_case(args: argparse.Namespace) -> dict[str, Any]:
    """The child: build the case's state, plan it with the memory it really has, measure."""
    if args.child.startswith("small:"):
        count = int(args.child.split(":", 1)[1])
        state: Any = {f"t{i:06d}": torch.randn(args.small_numel) for i in range(count)}
        tensors = list(state.values())
    else:
        work = h.build_workload(float(args.child), hidden=HIDDEN)
        state, tensors = work.state, h.state_tensors(work)
    plan = choose_plan(h.state_bytes(tensors), available=h.memory_available_bytes(), shm_free=h.shm_free_bytes(),
                       workers=args.workers, sequential=args.sequential)
    if plan is None:
        return {"error": f"case {args.child}: not enough memory left after building the state "
                         f"({h.memory_available_bytes() / h.GIB:.1f} GiB available); nothing measured"}
    try:
        result = measure(state, tensors, args.dir, plan, args)
    except MemoryError as e:
        return {"error": f"case {args.child}: {e}; nothing measured"}
    if args.child.startswith("small:"):
        extra = (result["mpckpt_median_ms"] - result["floor_median_ms"]) * 1e3 / count
        return {"case": "small", **result, "extra_us_per_tensor": extra,
                "floor_us_per_tensor": result["floor_median_ms"] * 1e3 / count}
    return {"case": "size", "gib": float(args.child), **result}


# -- the driver --------------------------------------------------------------------------------
def parse_list(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


def cases_of(args: argparse.Namespace) -> list[str]:
    small = [f"small:{int(n)}" for n in parse_list(args.small_counts) if int(n) > 0]
    return parse_list(args.sizes) + small


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    folder, remove = h.target_dir(args.dir, "scaling-")
    cases = cases_of(args)
    try:
        footprints = {c: Footprint.of_case(c, small_numel=args.small_numel) for c in cases}
        refused = [r for c in cases if (r := refusal(c, footprints[c], workers=args.workers, folder=folder))]
        if refused:  # before anything runs: a sweep that would stop halfway is no use
            raise SystemExit("scaling.py: refusing to start:\n  " + "\n  ".join(refused))
        results = [run_one(case, footprints[case], folder, args) for case in cases]
    finally:
        if remove:
            shutil.rmtree(folder, ignore_errors=True)
    return summarize(args, results)


def run_one(case: str, footprint: Footprint, folder: str, args: argparse.Namespace) -> dict[str, Any]:
    print(f"[scaling] {case} ...", file=sys.stderr, flush=True)
    busy = h.wait_for_quiet(args.wait_quiet_s)
    why = refusal(case, footprint, workers=args.workers, folder=folder)  # memory may have gone meanwhile
    if why:
        return {"case": case, "error": why}
    case_dir = os.path.join(folder, case.replace(":", "-"))
    argv = [os.path.abspath(__file__), "--child", case, "--reps", str(args.reps), "--workers", str(args.workers),
            "--small-numel", str(args.small_numel), "--dir", case_dir]
    argv += (["--profile"] if args.profile else []) + (["--sequential"] if args.sequential else [])
    try:
        return {"case": case, "busy_before_pct": busy, **h.run_child(argv, sample_ms=100)}
    finally:
        shutil.rmtree(case_dir, ignore_errors=True)


def summarize(args: argparse.Namespace, results: list[dict[str, Any]]) -> dict[str, Any]:
    sizes = [r for r in results if r.get("case") == "size"]
    xs = [r["bytes"] / h.GIB for r in sizes]
    floor_slope, _ = h.fit_slope(xs, [r["floor_median_ms"] for r in sizes])
    mpckpt_slope, mpckpt_icpt = h.fit_slope(xs, [r["mpckpt_median_ms"] for r in sizes])
    return {"benchmark": "scaling", "date": time.strftime("%Y-%m-%d"), "args": vars(args),
            "machine": h.machine_info(),
            "floor_ms_per_gib": floor_slope, "mpckpt_ms_per_gib": mpckpt_slope, "mpckpt_intercept_ms": mpckpt_icpt,
            "slope_ratio": mpckpt_slope / floor_slope if floor_slope else None,
            "sizes": sizes, "small": [r for r in results if r.get("case") == "small"],
            "errors": [r for r in results if "error" in r]}


def print_report(summary: dict[str, Any]) -> None:
    def shown(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{**r, "interleaved": "yes" if r["interleaved"] else "no (floor first)"} for r in rows]

    print(h.markdown_table(shown(summary["sizes"]), SWEEP_COLUMNS))
    print(f"\nslope: floor {h.fmt(summary['floor_ms_per_gib'])} ms/GiB, mpckpt {h.fmt(summary['mpckpt_ms_per_gib'])} "
          f"ms/GiB (ratio {h.fmt(summary['slope_ratio'], 2)})")
    if summary["small"]:
        print(f"\nsmall tensors ({summary['args']['small_numel']} float32 each); "
              f"goal: mpckpt adds at most {GOAL_US_PER_TENSOR:g} us per tensor\n")
        print(h.markdown_table(shown(summary["small"]), SMALL_COLUMNS))
    for err in summary["errors"]:
        print(f"error in case {err['case']}: {err['error']}")


def draw_chart(summary: dict[str, Any], path: str) -> bool:
    """Blocked ms against GiB (left) and us per tensor against tensor count (right); False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print(f"note: matplotlib is not installed; no chart written to {path}", file=sys.stderr)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    draw_sizes(left, summary)
    draw_small(right, summary)
    m = summary["machine"]
    fig.suptitle(f"mpckpt blocked time per save, {summary['date']}: {m['cpus']} CPUs ({m['cpu_model']}), "
                 f"{m['memory_gib']:g} GiB RAM, torch {m['torch']}", fontsize=10)
    note = f"medians of {summary['args']['reps']} saves per case, each awaited before the next"
    if any(not r["interleaved"] for r in summary["sizes"] + summary["small"]):
        note += "; hollow points: floor copies first, then the saves (memory does not hold both at once)"
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.text(0.01, 0.01, note, fontsize=8, color="#555555")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def draw_sizes(ax: Any, summary: dict[str, Any]) -> None:
    from matplotlib.ticker import FuncFormatter, NullFormatter

    rows = sorted(summary["sizes"], key=lambda r: r["bytes"])
    ax.set_title("against state size", fontsize=10)
    if not rows:
        ax.text(0.5, 0.5, "no size cases in this run", ha="center", va="center", transform=ax.transAxes)
        return
    xs = [r["bytes"] / h.GIB for r in rows]
    for key, label, color, slope in (("floor_median_ms", "floor (bare copy_ into shm)", "#7f7f7f", "floor_ms_per_gib"),
                                     ("mpckpt_median_ms", "mpckpt save (ASYNC)", "#d62728", "mpckpt_ms_per_gib")):
        ys = [r[key] for r in rows]
        ax.plot(xs, ys, "o-", color=color, label=f"{label}: slope {h.fmt(summary[slope], 0)} ms/GiB")
        hollow = [(x, y) for x, y, r in zip(xs, ys, rows, strict=True) if not r["interleaved"]]
        if hollow:
            ax.plot(*zip(*hollow, strict=True), "o", color=color, markerfacecolor="white")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(xs, [f"{x:.2g}" for x in xs])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:,g}" if f"{v:g}"[0] in "25" else ""))
    ax.set_xlabel("checkpoint state, GiB (params + 2 Adam moments; log)")
    ax.set_ylabel("median blocked time per save, ms (log)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


def draw_small(ax: Any, summary: dict[str, Any]) -> None:
    from matplotlib.ticker import NullFormatter

    rows = sorted(summary["small"], key=lambda r: r["tensors"])
    ax.set_title("fixed cost per tensor", fontsize=10)
    if not rows:
        ax.text(0.5, 0.5, "no small-tensor cases in this run", ha="center", va="center", transform=ax.transAxes)
        return
    xs = [r["tensors"] for r in rows]
    for key, style, color, label in (("extra_us_per_tensor", "o-", "#d62728", "mpckpt adds: (mpckpt - floor) / tensors"),
                                     ("floor_us_per_tensor", "o--", "#7f7f7f", "floor / tensors")):
        ys = [r[key] for r in rows]
        ax.plot(xs, ys, style, color=color, label=label)
        hollow = [(x, y) for x, y, r in zip(xs, ys, rows, strict=True) if not r["interleaved"]]
        if hollow:
            ax.plot(*zip(*hollow, strict=True), "o", color=color, markerfacecolor="white")
    ax.axhline(GOAL_US_PER_TENSOR, color="black", linestyle=":", linewidth=1,
               label=f"goal: at most {GOAL_US_PER_TENSOR:g} us/tensor")
    ax.set_xscale("log")
    ax.set_xticks(xs, [f"{x:,}" for x in xs])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_ylim(bottom=min([0.0, *(r["extra_us_per_tensor"] for r in rows)]))
    ax.set_xlabel(f"tensors in the state ({summary['args']['small_numel']} float32 each; log)")
    ax.set_ylabel("us per tensor")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="0.25,0.5,1,2,4,8", help="comma list of GiB (params + Adam moments)")
    p.add_argument("--small-counts", "--small-count", dest="small_counts", default="1000,10000,100000",
                   help="comma list of tensor counts for the small-tensor cases (0: none)")
    p.add_argument("--small-numel", type=int, default=256, help="float32 elements per small tensor")
    p.add_argument("--reps", type=int, default=5, help="saves per case")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--sequential", action="store_true",
                   help="run every case floor first (as the cases too large to interleave are)")
    p.add_argument("--out", default=os.path.join(h.RESULTS_DIR, "scaling.json"))
    p.add_argument("--chart", default=os.path.join(h.REPO_DIR, "docs", "bench_scaling.png"),
                   help="PNG to write (empty: none)")
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
        h.emit_result(run_case(args))
        return
    summary = run_all(args)
    h.write_json(args.out, summary)
    print_report(summary)
    print(f"\nresults: {args.out}")
    if args.chart and (summary["sizes"] or summary["small"]) and draw_chart(summary, args.chart):
        print(f"chart: {args.chart}")


if __name__ == "__main__":
    main()
