"""How long a Checkpointer takes to open (uploaders started and answering) and to close.

For each start method (``--methods``: ``forkserver``, mpckpt's default, and ``fork`` and
``spawn``, the others ``start_method=`` / ``MPCKPT_START_METHOD`` accept) and each uploader
count (``--workers``), in a fresh subprocess, ``--repeats`` times (cases alternate, so that
this machine's drift hits all alike):

  import   ``import mpckpt`` and the first use of ``mpckpt.Checkpointer`` (the package loads its
           names lazily), once per process, with torch already imported as in a training script
  open     ``Checkpointer(dir, workers=N, start_method=M)``: settings, the writer lock, the
           recovery scan of the (empty) folder, N uploader processes started and answering a ping
  close    ``close()`` with nothing pending: uploaders stopped and joined, the lock released

Open 1 is the first in its process (``forkserver`` starts its server then, which imports
mpckpt's worker module); opens 2..``--reps`` are later ones in the same process, into the
same folder. ``--state-mib`` holds that much touched memory in the child while it opens:
``fork`` copies the page tables of the whole training process, the other methods do not.
Peak MiB is the summed PSS of the child's process tree (uploaders and fork server included).

    .venv/bin/python bench/open_time.py --workers 1,2,4 --reps 5 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from typing import Any

import _harness as h

METHODS = ("forkserver", "fork", "spawn")  # mpckpt.config.START_METHODS, the default first
COLUMNS = [
    ("method", "start method", 0), ("workers", "workers", 0), ("processes", "runs", 0),
    ("import_ms", "import ms", 0), ("first_open_ms", "first open ms", 1), ("later_open_ms", "later open ms", 1),
    ("first_close_ms", "first close ms", 1), ("later_close_ms", "later close ms", 1),
    ("peak_mib", "peak MiB", 0), ("foreign_cpu_pct", "other procs CPU %", 0),
]


def run_case(args: argparse.Namespace) -> dict[str, Any]:
    """The child: import mpckpt, then open and close ``reps`` Checkpointers; every figure in ms."""
    import torch  # already loaded by _harness, as a training script has it before mpckpt

    started = time.perf_counter()
    import mpckpt

    checkpointer = mpckpt.Checkpointer  # the package loads its names on first use
    import_ms = (time.perf_counter() - started) * 1e3
    method, workers = args.child.split(":")
    ballast = torch.ones(args.state_mib * h.MIB // 4) if args.state_mib else None  # touched: pages exist
    folder = os.path.join(args.dir, "run")
    open_ms, close_ms, uploaders = [], [], []
    for _ in range(args.reps):
        started = time.perf_counter()
        ckpt = checkpointer(folder, workers=int(workers), start_method=method)
        open_ms.append((time.perf_counter() - started) * 1e3)
        uploaders.append(len(ckpt.uploader_pids))
        started = time.perf_counter()
        ckpt.close()
        close_ms.append((time.perf_counter() - started) * 1e3)
    del ballast
    return {"method": method, "workers": int(workers), "import_ms": import_ms, "uploaders": uploaders,
            "open_ms": [round(x, 3) for x in open_ms], "close_ms": [round(x, 3) for x in close_ms]}


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    cases = [f"{m}:{int(n)}" for m in parse_list(args.methods) for n in parse_list(args.workers)]
    unknown = sorted({c.split(":")[0] for c in cases} - set(METHODS))
    if unknown:
        raise SystemExit(f"open_time.py: unknown start method(s) {', '.join(unknown)}; use {', '.join(METHODS)}")
    folder, remove = h.target_dir(args.dir, "open-time-")
    runs: list[dict[str, Any]] = []
    try:
        for repeat in range(args.repeats):
            for case in cases:
                print(f"[open_time] {case} ({repeat + 1}/{args.repeats}) ...", file=sys.stderr, flush=True)
                case_dir = os.path.join(folder, case.replace(":", "-"))
                argv = [os.path.abspath(__file__), "--child", case, "--reps", str(args.reps),
                        "--state-mib", str(args.state_mib), "--dir", case_dir]
                busy = h.wait_for_quiet(args.wait_quiet_s)
                try:
                    result = h.run_child(argv, sample_ms=args.sample_ms, timeout_s=600)
                finally:
                    shutil.rmtree(case_dir, ignore_errors=True)
                runs.append({"case": case, "busy_before_pct": busy, **result})
    finally:
        if remove:
            shutil.rmtree(folder, ignore_errors=True)
    return {"benchmark": "open_time", "date": time.strftime("%Y-%m-%d"), "args": vars(args),
            "machine": h.machine_info(), "rows": [summarize(c, runs) for c in cases], "runs": runs,
            "errors": [r for r in runs if "error" in r]}


def parse_list(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


def summarize(case: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One table row: medians over the case's processes (first open) and over all later opens."""
    method, workers = case.split(":")
    ok = [r for r in runs if r["case"] == case and "error" not in r]
    return {
        "method": method, "workers": int(workers), "processes": len(ok),
        "import_ms": h.median([r["import_ms"] for r in ok]),
        "first_open_ms": h.median([r["open_ms"][0] for r in ok]),
        "later_open_ms": h.median([x for r in ok for x in r["open_ms"][1:]]),
        "first_close_ms": h.median([r["close_ms"][0] for r in ok]),
        "later_close_ms": h.median([x for r in ok for x in r["close_ms"][1:]]),
        "peak_mib": h.median([r["peak_mib"] for r in ok]),
        "foreign_cpu_pct": max((r["foreign_cpu_pct"] for r in ok), default=None),
    }


def print_report(summary: dict[str, Any]) -> None:
    args = summary["args"]
    print(f"medians over {args['repeats']} process(es) per row; later opens: opens 2..{args['reps']} of each; "
          f"{args['state_mib']} MiB of state held while opening\n")
    print(h.markdown_table(summary["rows"], COLUMNS))
    for err in summary["errors"]:
        print(f"error in case {err['case']}: {err['error']}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="1,2,4", help="comma list of uploader counts")
    p.add_argument("--methods", default=",".join(METHODS), help="comma list of start methods")
    p.add_argument("--reps", type=int, default=5, help="opens per process (the first one is reported apart)")
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per case")
    p.add_argument("--state-mib", type=int, default=0, help="touched memory the child holds while it opens")
    p.add_argument("--sample-ms", type=float, default=50, help="memory sampling period")
    p.add_argument("--out", default=os.path.join(h.RESULTS_DIR, "open_time.json"))
    p.add_argument("--dir", default=None, help="target folder (default: a temporary one under bench/results/)")
    p.add_argument("--wait-quiet-s", type=float, default=30,
                   help="before each process, wait up to this long for other processes to leave the CPUs idle")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.reps < 1 or args.repeats < 1:
        p.error("--reps and --repeats must be at least 1")
    return args


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


if __name__ == "__main__":
    main()
