"""Read throughput of ``mpckpt.load`` from local disk, against a plain read of the same files.

A checkpoint of the house workload (``--gib`` GiB: ``nn.Linear`` layers + Adam moments, see
``_harness.build_workload``) is written once into ``--dir`` and kept there, so later runs (and
runs of other checkouts) read the very same files. Then every repetition is a fresh
subprocess that imports mpckpt, times ``mpckpt.load(dir)`` and reports its peak RSS
(``VmHWM``) next to its resident memory just before loading (torch imported). Two cache states:

- cold: ``sync`` and ``echo 1 > /proc/sys/vm/drop_caches`` before each repetition (needs
  root; where it is refused the cold rows are left out and the table says so);
- warm: the files are in the page cache (one untimed read first).

``raw read`` is the floor: every file read into one preallocated, touched buffer with 64 MiB
``preadv`` calls on as many threads as ``mpckpt.load`` uses, no hashing, no allocation. Which mpckpt is measured is whatever ``import mpckpt`` finds, so an older
checkout is measured with ``PYTHONPATH=/path/to/checkout``; ``--baseline PATH`` measures that
checkout too, in the same run, repetitions interleaved with the current one (the fairest
comparison on a noisy machine). Figures are medians; MB/s counts every byte of the files read.

    .venv/bin/python bench/read_throughput.py --gib 1 --reps 5
    git worktree add /tmp/mpckpt-old HEAD~1
    .venv/bin/python bench/read_throughput.py --gib 1 --reps 5 --baseline /tmp/mpckpt-old
    PYTHONPATH=/tmp/mpckpt-old .venv/bin/python bench/read_throughput.py   # the old one alone
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import _harness as h

RAW_THREADS = 8  # as many as mpckpt.load reads with
RAW_CHUNK = 64 << 20
COLUMNS = [("what", "what", 0), ("cache", "cache", 0), ("mib", "MiB", 0), ("median_s", "median s", 3),
           ("mb_per_s", "MB/s", 0), ("peak_rss_mib", "peak RSS MiB", 0), ("rss_before_mib", "RSS before MiB", 0),
           ("runs_s", "runs s", 0)]


# -- the checkpoint, written once --------------------------------------------------------------
def step_folder(root: str) -> str | None:
    """The committed checkpoint folder under ``root``, if there is one."""
    if not os.path.isdir(root):
        return None
    for name in sorted(os.listdir(root)):
        if name.startswith("step_") and os.path.exists(os.path.join(root, name, "manifest.json")):
            return os.path.join(root, name)
    return None


def write_child(root: str, gib: float) -> None:
    import mpckpt

    work = h.build_workload(gib)
    with mpckpt.Checkpointer(root, workers=2) as ckpt:
        ckpt.save(0, work.state, mode="sync")
    h.emit_result({"written": step_folder(root)})


def write_checkpoint(root: str, gib: float) -> str:
    """Written by a child, so this driver stays small (children inherit nothing of it)."""
    result = h.run_child([os.path.abspath(__file__), "--write", root, "--gib", str(gib)])
    folder = step_folder(root)
    if result.get("status") == "error" or folder is None:
        raise RuntimeError(f"writing the checkpoint into {root} failed: {result}")
    return folder


# -- one repetition, in a fresh process ---------------------------------------------------------
def child(root: str) -> None:
    import mpckpt
    import mpckpt.checkpointer  # noqa: F401 - torch and the read path, imported before the clock starts

    rss_before = _status_bytes("VmRSS")
    started = time.perf_counter()
    state = mpckpt.load(root)
    load_s = time.perf_counter() - started
    peak = _status_bytes("VmHWM")
    del state
    h.emit_result({"load_s": load_s, "peak_rss_bytes": peak, "rss_before_bytes": rss_before,
                   "mpckpt": os.path.dirname(os.path.abspath(mpckpt.__file__))})


def _status_bytes(field: str) -> int:
    """A size from /proc/self/status. VmHWM is this process's own peak RSS: unlike ru_maxrss,
    it does not carry over the parent's peak through fork + exec."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def raw_child(folder: str) -> None:
    """Every file into one preallocated, touched buffer with ``RAW_THREADS`` threads of 64 MiB preads."""

    paths = [os.path.join(folder, n) for n in sorted(os.listdir(folder)) if n != "manifest.json"]
    buffer = memoryview(bytearray(sum(os.path.getsize(p) for p in paths)))
    h.emit_result({"load_s": h.read_files_into(paths, buffer, threads=RAW_THREADS, chunk=RAW_CHUNK)})


def drop_caches() -> bool:
    """Empty the page cache; False where that is not allowed (not root, read-only /proc)."""
    h.sync_disk()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def warm(folder: str) -> None:
    for name in os.listdir(folder):
        with open(os.path.join(folder, name), "rb") as f:
            while f.read(64 << 20):
                pass


def one_run(kind: str, target: str, pythonpath: str | None) -> dict[str, Any]:
    """``kind``: 'load' (mpckpt.load of ``target``, a root) or 'raw' (``target``, a step folder)."""
    env_before = os.environ.get("PYTHONPATH")
    if pythonpath is not None:
        os.environ["PYTHONPATH"] = pythonpath
    try:
        flag = "--child" if kind == "load" else "--raw-child"
        result = h.run_child([os.path.abspath(__file__), flag, target])
    finally:
        if env_before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = env_before
    if result.get("status") == "error":
        raise RuntimeError(f"{kind} of {target} failed: {result['error']}")
    return result


def measure(args: argparse.Namespace) -> dict[str, Any]:
    root = os.path.abspath(args.dir)
    folder = step_folder(root)
    if folder is None:
        print(f"writing a {args.gib} GiB checkpoint into {root} (once) ...", file=sys.stderr)
        folder = write_checkpoint(root, args.gib)
    nbytes = h.folder_bytes(folder) - os.path.getsize(os.path.join(folder, "manifest.json"))
    cold_ok = drop_caches()
    caches = [c for c in args.cache.split(",") if c != "cold" or cold_ok]
    subjects: list[tuple[str, str, str | None]] = [(f"raw read ({RAW_THREADS} threads, no hash)", "raw", None)]
    if args.baseline:
        subjects.append(("mpckpt.load (baseline)", "load", os.path.abspath(args.baseline)))
    subjects.append(("mpckpt.load, this checkout" if args.baseline else "mpckpt.load", "load", None))
    busy = h.wait_for_quiet(args.wait_quiet_s)
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for cache in caches:
        if cache == "warm":
            warm(folder)
        for _ in range(args.reps):
            h.wait_for_quiet(args.quiet_each_s)  # each round: keep other people's jobs out where possible
            for label, kind, pythonpath in subjects:  # interleaved: drift hits every subject alike
                if cache == "cold":
                    drop_caches()
                target = root if kind == "load" else folder
                runs.setdefault((label, cache), []).append(one_run(kind, target, pythonpath))
    rows = []
    for (label, cache), results in runs.items():
        seconds = [r["load_s"] for r in results]
        med = h.median(seconds)
        rows.append({
            "what": label, "cache": cache, "mib": nbytes / h.MIB, "median_s": med, "mb_per_s": nbytes / 1e6 / med,
            "peak_rss_mib": h.median([r["peak_rss_bytes"] / h.MIB for r in results]) if "peak_rss_bytes" in results[0] else None,
            "rss_before_mib": h.median([r["rss_before_bytes"] / h.MIB for r in results]) if "rss_before_bytes" in results[0] else None,
            "runs_s": ", ".join(f"{s:.2f}" for s in seconds),
            "mpckpt": results[0].get("mpckpt"),
            "foreign_cpu_pct_max": max(r.get("foreign_cpu_pct", 0.0) for r in results),
        })
    ratios = {}
    if args.baseline:
        for cache in caches:
            by = {r["what"]: r for r in rows if r["cache"] == cache}
            new = by["mpckpt.load, this checkout"]["mb_per_s"]
            old = by["mpckpt.load (baseline)"]["mb_per_s"]
            ratios[cache] = new / old
    return {"benchmark": "read_throughput", "args": vars(args), "machine": h.machine_info(), "checkpoint": folder,
            "bytes": nbytes, "cold_cache_available": cold_ok, "rows": rows, "ratio_this_over_baseline": ratios,
            "busy_before_pct": busy}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="size of the checkpoint written the first time")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--cache", default="cold,warm", help="comma list of cold, warm")
    p.add_argument("--dir", default=os.path.join(h.RESULTS_DIR, "read_throughput_ckpt"),
                   help="checkpoint root; written once, reused by later runs")
    p.add_argument("--baseline", default=None, help="another checkout (its repository root) to measure alongside")
    p.add_argument("--out", default=os.path.join(h.RESULTS_DIR, "read_throughput.json"))
    p.add_argument("--wait-quiet-s", type=float, default=20,
                   help="first wait up to this long for other processes to leave the CPUs idle")
    p.add_argument("--quiet-each-s", type=float, default=10,
                   help="before each round of repetitions, wait up to this long for idle CPUs")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--raw-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--write", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.child:
        return child(args.child)
    if args.raw_child:
        return raw_child(args.raw_child)
    if args.write:
        return write_child(args.write, args.gib)
    summary = measure(args)
    h.write_json(args.out, summary)
    print(h.markdown_table(summary["rows"], COLUMNS))
    if not summary["cold_cache_available"]:
        print("\nthe page cache could not be dropped (needs root): no cold-cache rows")
    for cache, ratio in summary["ratio_this_over_baseline"].items():
        print(f"this checkout / baseline, {cache} cache: {ratio:.2f}x")
    print(f"results: {args.out}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
