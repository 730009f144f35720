"""How far durability lags behind saving under a busy CPU, per uploader priority.

A training loop keeps every core busy (torch's intra-op threads = the core count; forward,
backward and Adam on a ``hidden x hidden`` MLP with a large batch) and saves its ~10 MiB state
(model + Adam moments) every ``--every`` steps, ASYNC, into a local folder. For each
``uploader_priority`` (``idle``, the default: SCHED_IDLE + nice 10; ``low``: nice 10;
``normal``: as training), and once without checkpoints (``none``) for the bare step time, in a
fresh subprocess:

  step ms       median and mean training step (the mean counts the steps that saved: what
                training really pays), over every step after a warm-up; and the training
                process's CPU time in % of all cores (how busy training keeps the machine)
  durable ms    median and 90th percentile of the time from ``save`` to the commit
                (``SaveStats.durable_ms``)
  waiting       the most later saves already taken when a save committed (``SaveStats.waiting``)
  lost if killed  at the start of each step, the steps since the newest durable checkpoint
                (what a SIGKILL at that instant loses): median and max over the steps

    .venv/bin/python bench/uploader_priority.py --wait-quiet-s 60   # 210 steps, a save every 7
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from typing import Any

import _harness as h

CASES = ("idle", "low", "normal", "none")
COLUMNS = [
    ("case", "uploader priority", 0), ("saves", "saves", 0), ("step_ms", "step ms (median)", 1),
    ("mean_step_ms", "step ms (mean)", 1), ("durable_ms", "save to durable ms (median)", 0),
    ("durable_p90_ms", "p90", 0), ("max_waiting", "most saves waiting", 0),
    ("lost_median", "steps lost if killed (median)", 0), ("lost_max", "(max)", 0),
    ("blocked_ms", "blocked in save ms", 1), ("training_cpu_pct", "training CPU % of all cores", 0),
    ("foreign_cpu_pct", "other procs CPU %", 0),
]


def run_case(args: argparse.Namespace) -> dict[str, Any]:
    """The child: train ``--steps`` steps, saving every ``--every`` (unless case ``none``)."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)  # training alone keeps every core busy
    work = h.build_workload(args.state_mib / 1024, hidden=args.hidden, batch=args.batch)
    state_bytes = h.state_bytes(h.state_tensors(work))
    case = args.child
    ckpt = None
    if case != "none":
        import mpckpt

        ckpt = mpckpt.Checkpointer(os.path.join(args.dir, "run"), workers=args.workers, uploader_priority=case)
    committed_at: dict[int, float] = {}
    starts: list[float] = []
    step_s: list[float] = []
    futures = []
    for step in range(args.warmup + args.steps):
        started = time.perf_counter()
        if step == args.warmup:
            cpu0, wall0 = _cpu_s(), started
        if step >= args.warmup:
            starts.append(started)
        h.train_step(work)
        if ckpt is not None and step >= args.warmup and (step - args.warmup) % args.every == 0:
            future = ckpt.save(step, work.state)
            future.add_done_callback(lambda f: committed_at.setdefault(f.step, time.perf_counter()))
            futures.append(future)
        if step >= args.warmup:
            step_s.append(time.perf_counter() - started)
    busy_pct = 100 * (_cpu_s() - cpu0) / (time.perf_counter() - wall0) / (os.cpu_count() or 1)
    result: dict[str, Any] = {"case": case, "state_bytes": state_bytes, "step_ms": [round(s * 1e3, 3) for s in step_s],
                              "training_cpu_pct": round(busy_pct, 1)}
    if ckpt is not None:
        ckpt.close()
        saves = [f.stats for f in futures]
        result.update(durable_ms=[round(s.durable_ms, 3) for s in saves], waiting=[s.waiting for s in saves],
                      blocked_ms=[round(s.blocked_ms, 3) for s in saves],
                      lost=_lost_if_killed(starts, args.warmup, committed_at))
    return result


def _cpu_s() -> float:
    """CPU seconds of this process, all its threads (the training loop)."""
    t = os.times()
    return t.user + t.system


def _lost_if_killed(starts: list[float], first: int, committed_at: dict[int, float]) -> list[int]:
    """For each step (``first`` + i, started at ``starts[i]``): the steps a kill then loses,
    back to the newest step committed by that instant (all of them before the first commit)."""
    lost = []
    for i, at in enumerate(starts):
        durable = [s for s, t in committed_at.items() if t <= at]
        step = first + i
        lost.append(step - max(durable) if durable else i)
    return lost


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {"case": result["case"], "step_ms": h.median(result["step_ms"]),
                           "mean_step_ms": sum(result["step_ms"]) / len(result["step_ms"]),
                           "training_cpu_pct": result["training_cpu_pct"],
                           "foreign_cpu_pct": result.get("foreign_cpu_pct")}
    if "durable_ms" in result:
        row.update(saves=len(result["durable_ms"]), durable_ms=h.median(result["durable_ms"]),
                   durable_p90_ms=h.percentile(result["durable_ms"], 90), max_waiting=max(result["waiting"]),
                   lost_median=h.median(result["lost"]), lost_max=max(result["lost"]),
                   blocked_ms=h.median(result["blocked_ms"]))
    return row


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    folder, remove = h.target_dir(args.dir, "uploader-priority-")
    runs: list[dict[str, Any]] = []
    try:
        for case in args.cases.split(","):
            if case not in CASES:
                raise SystemExit(f"uploader_priority.py: unknown case {case!r}; use {', '.join(CASES)}")
            print(f"[uploader_priority] {case} ...", file=sys.stderr, flush=True)
            case_dir = os.path.join(folder, case)
            argv = [os.path.abspath(__file__), "--child", case, "--dir", case_dir, "--steps", str(args.steps),
                    "--warmup", str(args.warmup), "--every", str(args.every), "--state-mib", str(args.state_mib),
                    "--hidden", str(args.hidden), "--batch", str(args.batch), "--workers", str(args.workers)]
            busy = h.wait_for_quiet(args.wait_quiet_s)
            try:
                result = h.run_child(argv, timeout_s=1200)
            finally:
                shutil.rmtree(case_dir, ignore_errors=True)
            runs.append({"busy_before_pct": busy, **result})
    finally:
        if remove:
            shutil.rmtree(folder, ignore_errors=True)
    ok = [r for r in runs if "error" not in r]
    return {"benchmark": "uploader_priority", "date": time.strftime("%Y-%m-%d"), "args": vars(args),
            "machine": h.machine_info(), "rows": [summarize(r) for r in ok], "runs": runs,
            "errors": [r for r in runs if "error" in r]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=",".join(CASES), help="comma list of: " + ", ".join(CASES))
    p.add_argument("--steps", type=int, default=210, help="timed training steps per case")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    p.add_argument("--every", type=int, default=7, help="save every this many steps")
    p.add_argument("--state-mib", type=float, default=10, help="checkpoint state (model + Adam moments)")
    p.add_argument("--hidden", type=int, default=512, help="width of the MLP's layers")
    p.add_argument("--batch", type=int, default=512, help="rows per step (sets the step's compute)")
    p.add_argument("--workers", type=int, default=2, help="uploader processes")
    p.add_argument("--out", default=os.path.join(h.RESULTS_DIR, "uploader_priority.json"))
    p.add_argument("--dir", default=None, help="target folder (default: a temporary one under bench/results/)")
    p.add_argument("--wait-quiet-s", type=float, default=30,
                   help="before each case, wait up to this long for other processes to leave the CPUs idle")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < args.every or args.every < 1:
        p.error("--steps must be at least --every, and --every at least 1")
    return args


def main() -> None:
    args = parse_args()
    if args.child:
        os.makedirs(args.dir, exist_ok=True)
        h.emit_result(run_case(args))
        return
    summary = run_all(args)
    h.write_json(args.out, summary)
    print(f"{os.cpu_count()} cores, torch threads = cores; {summary['rows'][0]['saves'] if summary['rows'] else '-'} "
          f"saves of {args.state_mib:g} MiB, one every {args.every} steps; one run per case\n")
    print(h.markdown_table(summary["rows"], COLUMNS))
    for err in summary["errors"]:
        print(f"error: {err['error']}")
    print(f"\nresults: {args.out}")


if __name__ == "__main__":
    main()
