"""Opening a writer that finds a snapshot kept in memory, against one that finds none (issue 38).

What a trainer restarted on the same node pays before its first step, phase by phase, when the
trainer before it was SIGKILLed right after ``save()`` returned, and when nothing was kept: for
each size in ``--ranks``, 1 being one process and more a job under torchrun (gloo, CPU, torch on
one thread per rank; each rank holds the same ``--gib`` GiB state of plain tensors, so it writes
and keeps about half of it and restores all of it). Every case is a fresh process (a fresh job),
each round runs every case once in a rotated order (``--repeats`` rounds), the optimizer is
stepped before the clock (every tensor exists: restores and floors write into touched memory),
torch and mpckpt are imported before it, and the storage checkpoints are in the page cache (read
once, untimed). The roots (step 1 committed) are written once into ``--dir`` and reused.

- ``open_empty``: ``Checkpointer(root)`` on a root whose newest step is on storage and of which
  nothing is kept in memory (a), then ``restore`` from storage (d);
- ``open_kept``: the same on a root of which a killed trainer kept a newer step (b), then
  ``restore`` from memory (c), asserted so; it closes leaving the snapshot (the round's segment
  floor reads it). The killer, untimed, runs before each round: it opens the root, saves step 2
  with ``mode="memory"`` and SIGKILLs itself as ``save()`` returns (a job's ranks after a
  barrier), so a single process's record is usually still pending (its checksums not in it yet:
  the open computes them), which the report counts; a rank's record never is;
- ``floor_read``: the storage checkpoint's shard files read into one touched buffer of their
  size with 64 MiB ``preadv`` calls on 2 threads (no hash): the floor of (d);
- ``floor_segment``: the kept snapshot's data files mapped read-only and their shards' bytes
  copied into one touched buffer with ``memmove`` on 2 threads (no hash): a copy from a surviving
  shared-memory segment, the floor of (c). In a job each rank copies every rank's kept bytes (what
  it restores).

In a job each rank's timings start at a barrier, and a job's figure is its slowest rank's. Figures
are medians; ``x`` columns divide a median by a floor's; the CPU other processes used while a
case ran is reported (``_harness``). A second table gives the issue's targets as ratios of
medians. ``--pythonpath`` measures another checkout's mpckpt (the killer's too).

    .venv/bin/python bench/open_kept.py --gib 1 --repeats 3 --ranks 1,2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

import _harness as h

CHUNK = 64 << 20
CASES = ("open_empty", "open_kept", "floor_read", "floor_segment")
KILLED_STEP = 2
ROWS = [  # (key, label, floor it is compared with)
    ("floor_read", "readinto floor (storage files, 2 threads, no hash)", "read"),
    ("floor_segment", "segment copy floor (kept in /dev/shm, 2 threads, no hash)", "segment"),
    ("open_empty", "(a) open, nothing kept", None),
    ("open_kept", "(b) open, a kept snapshot found", None),
    ("restore_storage", "(d) restore from storage", "read"),
    ("restore_memory", "(c) restore from memory", "segment"),
    ("total_storage", "(a+d) open + restore from storage", "read"),
    ("total_memory", "(b+c) open + restore from memory", "segment"),
]
COLUMNS = [("ranks", "ranks", 0), ("what", "what", 0), ("median_ms", "median ms", 1), ("x_floor", "x its floor", 2),
           ("x_read", "x readinto floor", 2), ("runs_ms", "runs ms", 0), ("foreign_cpu_pct", "other procs CPU % (max)", 1)]
CASE_OF = {"floor_read": "floor_read", "floor_segment": "floor_segment", "open_empty": "open_empty",
           "open_kept": "open_kept", "restore_storage": "open_empty", "restore_memory": "open_kept",
           "total_storage": "open_empty", "total_memory": "open_kept"}


# -- what runs in the children ---------------------------------------------------------------------
def roots(folder: str, ranks: int) -> tuple[str, str]:
    """(the root nothing is kept of, the root a killed trainer kept a snapshot of) for ``ranks``."""
    return os.path.join(folder, f"r{ranks}", "storage"), os.path.join(folder, f"r{ranks}", "memory")


def _bytes_of(t: Any) -> memoryview:
    import ctypes

    return memoryview((ctypes.c_char * t.numel()).from_address(t.data_ptr())).cast("B")


def _shards(root: str) -> list[str]:
    folder = os.path.join(root, sorted(n for n in os.listdir(root) if n.startswith("step_"))[-1])
    return [os.path.join(d, n) for d, _, files in os.walk(folder) for n in sorted(files) if n.endswith(".safetensors")]


def floor_read(root: str, barrier: Any) -> dict[str, Any]:
    import torch

    paths = _shards(root)
    total = sum(os.path.getsize(p) for p in paths)
    buffer = torch.ones(total, dtype=torch.uint8)  # touched, as live tensors are
    barrier()
    return {"ms": h.read_files_into(paths, _bytes_of(buffer), threads=2, chunk=CHUNK) * 1e3, "bytes": total}


def floor_segment(root: str, ranks: int, barrier: Any) -> dict[str, Any]:
    """Every rank's kept data file of ``root`` mapped read-only, its shards' bytes (one stretch per
    file) copied into a touched buffer by 2 threads."""
    import ctypes
    import mmap
    import threading

    import numpy as np
    import torch

    from mpckpt._keep.record import KeptRecord
    from mpckpt._keep.store import SHM_DIR

    maps: list[Any] = []
    views: list[Any] = []  # (each holds its map's buffer: dropped before the map is closed)
    stretches: list[tuple[int, int]] = []
    for rank in range(ranks):
        text = kept_record_text(root, rank)
        assert text is not None, f"no snapshot of step {KILLED_STEP} is kept for rank {rank} of {root}"
        record = KeptRecord.from_bytes(text, path=root)
        fd = os.open(os.path.join(SHM_DIR, record.data), os.O_RDONLY)
        try:
            data = mmap.mmap(fd, record.data_size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        start = min(s.offset for s in record.spans.values())
        end = max(s.offset + s.nbytes for s in record.spans.values())
        view = np.frombuffer(data, dtype=np.uint8)
        maps.append(data)
        views.append(view)
        stretches.append((int(view.ctypes.data) + start, end - start))
    del view
    total = sum(n for _, n in stretches)
    buffer = torch.ones(total, dtype=torch.uint8)  # touched, as live tensors are
    parts, at = [], buffer.data_ptr()
    for src, n in stretches:  # each stretch in two halves
        half = n // 2
        parts += [(at, src, half), (at + half, src + half, n - half)]
        at += n
    jobs = [parts[0::2], parts[1::2]]

    def copy(job: list[tuple[int, int, int]]) -> None:
        for part in job:
            ctypes.memmove(*part)  # releases the GIL

    threads = [threading.Thread(target=copy, args=(job,)) for job in jobs]
    barrier()
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ms = (time.perf_counter() - started) * 1e3
    views.clear()
    for data in maps:
        data.close()
    return {"ms": ms, "bytes": total}


def opened(root: str, work: Any, *, memory: bool, barrier: Any) -> dict[str, Any]:
    import mpckpt

    record = kept_record_text(root, int(os.environ.get("RANK", "0")))
    barrier()
    t0 = time.perf_counter()
    ckpt = mpckpt.Checkpointer(root)
    t1 = time.perf_counter()
    step = ckpt.restore(work.state)
    t2 = time.perf_counter()
    restored = ckpt.last_restore
    assert restored is not None
    want = (KILLED_STEP, "memory") if memory else (1, "storage")
    assert (step, restored.source) == want, f"restored step {step} from {restored.source}, expected {want}"
    ckpt.close(leave_in_memory=memory)  # the round's segment floor reads it
    return {"open_ms": (t1 - t0) * 1e3, "restore_ms": (t2 - t1) * 1e3, "close_ms": (time.perf_counter() - t2) * 1e3,
            "pending": record is not None and b'"xxh3_64":null' in record, "found": record is not None}


def kept_record_text(root: str, rank: int) -> bytes | None:
    """The text of the record of the snapshot of ``KILLED_STEP`` kept for ``root`` and ``rank``, or None."""
    from mpckpt._keep.store import SHM_DIR, base_name

    base = base_name(os.path.abspath(root), rank)
    for name in sorted(os.listdir(SHM_DIR)):  # (``base.record``, or ``base.<step>.record``)
        if name.startswith(base + ".") and name.endswith(".record"):
            with open(os.path.join(SHM_DIR, name), "rb") as f:
                text = f.read()
            if json.loads(text).get("step") == KILLED_STEP:
                return text
    return None


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One case in this process (a rank of a job under torchrun when ``--ranks`` > 1)."""
    import torch

    ranks = args.ranks
    barrier: Any = lambda: None  # noqa: E731
    if ranks > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks))
        barrier = dist.barrier
    storage, memory = roots(args.dir, ranks)
    started = time.perf_counter()
    import mpckpt.checkpointer  # noqa: F401  (what Checkpointer's first use imports: not timed)

    out: dict[str, Any] = {"case": args.child, "import_s": time.perf_counter() - started}
    if args.child == "floor_read":
        out.update(floor_read(storage, barrier))
    elif args.child == "floor_segment":
        out.update(floor_segment(memory, ranks, barrier))
    else:
        work = h.build_workload(args.gib)  # stepped once: every tensor exists
        import mpckpt

        if args.child == "write":
            for root in (storage, memory):
                with mpckpt.Checkpointer(root) as ckpt:
                    ckpt.save(1, work.state, mode="sync")
        elif args.child == "kill":
            ckpt = mpckpt.Checkpointer(memory)
            ckpt.save(KILLED_STEP, work.state, mode="memory")
            barrier()
            os.kill(os.getpid(), signal.SIGKILL)
        else:
            out.update(opened(memory if args.child == "open_kept" else storage, work, memory=args.child == "open_kept",
                              barrier=barrier))
    if ranks > 1:
        import torch.distributed as dist

        out["rank"] = dist.get_rank()
        with open(os.path.join(args.dir, f"result-{args.child}-{dist.get_rank()}.json"), "w") as f:
            json.dump(out, f)
        dist.barrier()
        dist.destroy_process_group()
    return out


# -- the driver ------------------------------------------------------------------------------------
def run_case(args: argparse.Namespace, case: str, ranks: int) -> list[dict[str, Any]]:
    """``case`` in a fresh process (a fresh job of ``ranks`` ranks): each rank's result."""
    argv = [os.path.abspath(__file__), "--child", case, "--dir", args.dir, "--gib", str(args.gib),
            "--ranks-child", str(ranks)]
    if ranks == 1:
        if case == "kill":
            subprocess.run([sys.executable, *argv], cwd=h.REPO_DIR, check=False, stderr=subprocess.DEVNULL)
            return []
        result = h.run_child(argv, sample_ms=1000)
        if result.get("status") == "error":
            raise SystemExit(f"{case} failed: {result['error']}")
        return [result]
    for r in range(ranks):
        path = os.path.join(args.dir, f"result-{case}-{r}.json")
        if os.path.exists(path):
            os.unlink(path)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--standalone", f"--nproc-per-node={ranks}", *argv]
    quiet = subprocess.DEVNULL if case == "kill" else None  # (its workers' deaths are the point)
    h.sync_disk()
    with h.TreeCpu() as cpu:
        proc = subprocess.Popen(cmd, cwd=h.REPO_DIR, stdout=quiet, stderr=quiet)
        cpu.watch(proc.pid)
        code = proc.wait()
    if case == "kill":
        return []
    if code != 0:
        raise SystemExit(f"{case} at {ranks} ranks failed (torchrun exited with {code})")
    out = []
    for r in range(ranks):
        with open(os.path.join(args.dir, f"result-{case}-{r}.json")) as f:
            out.append({**json.load(f), "foreign_cpu_pct": cpu.foreign_pct()})
    return out


def kill_round(args: argparse.Namespace, ranks: int) -> None:
    """A trainer (a job) that saves step 2 in memory only and is SIGKILLed as ``save()`` returns."""
    run_case(args, "kill", ranks)
    _, memory = roots(args.dir, ranks)
    time.sleep(0.5)  # (torchrun's agent reaps its killed workers)
    missing = [r for r in range(ranks) if kept_record_text(memory, r) is None]
    if missing:
        raise SystemExit(f"the killed trainer kept no snapshot of step {KILLED_STEP} for rank(s) {missing}")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    os.makedirs(args.dir, exist_ok=True)
    runs: list[dict[str, Any]] = []
    ranks_list = [int(x) for x in args.ranks_list.split(",") if x.strip()]
    for ranks in ranks_list:
        storage, memory = roots(args.dir, ranks)
        if not (os.path.isdir(storage) and os.path.isdir(memory)):
            print(f"[open_kept] writing step 1 at {ranks} rank(s) ...", file=sys.stderr, flush=True)
            shutil.rmtree(os.path.join(args.dir, f"r{ranks}"), ignore_errors=True)
            run_case(args, "write", ranks)
    for ranks in ranks_list:  # the page cache holds the storage checkpoints, as after one untimed read
        h.warm_page_cache(roots(args.dir, ranks)[0])
    h.wait_for_quiet(args.wait_quiet_s)
    for repeat in range(args.repeats):
        for ranks in ranks_list:
            kill_round(args, ranks)
            order = CASES[repeat % len(CASES):] + CASES[:repeat % len(CASES)]
            for case in order:
                print(f"[open_kept] {ranks} rank(s), {case} ({repeat + 1}/{args.repeats}) ...", file=sys.stderr,
                      flush=True)
                h.wait_for_quiet(args.wait_quiet_s)
                for result in run_case(args, case, ranks):
                    runs.append({"ranks": ranks, "repeat": repeat, **result})
    return {"benchmark": "open_kept", "date": time.strftime("%Y-%m-%d %H:%M"), "args": vars(args),
            "machine": h.machine_info(), "rows": summarize(runs, ranks_list), "runs": runs}


def per_job(runs: list[dict[str, Any]], ranks: int, case: str, key: str) -> list[float]:
    """``key`` of each repetition of ``case`` at ``ranks``: the slowest rank's."""
    by_repeat: dict[int, float] = {}
    for r in runs:
        if r["ranks"] == ranks and r["case"] == case and key in r:
            by_repeat[r["repeat"]] = max(by_repeat.get(r["repeat"], 0.0), r[key])
    return [by_repeat[k] for k in sorted(by_repeat)]


def summarize(runs: list[dict[str, Any]], ranks_list: list[int]) -> list[dict[str, Any]]:
    rows = []
    for ranks in ranks_list:
        series = {
            "floor_read": per_job(runs, ranks, "floor_read", "ms"),
            "floor_segment": per_job(runs, ranks, "floor_segment", "ms"),
            "open_empty": per_job(runs, ranks, "open_empty", "open_ms"),
            "open_kept": per_job(runs, ranks, "open_kept", "open_ms"),
            "restore_storage": per_job(runs, ranks, "open_empty", "restore_ms"),
            "restore_memory": per_job(runs, ranks, "open_kept", "restore_ms"),
        }
        for case, key in (("open_empty", "storage"), ("open_kept", "memory")):
            totals: dict[int, float] = {}
            for r in runs:
                if r["ranks"] == ranks and r["case"] == case:
                    totals[r["repeat"]] = max(totals.get(r["repeat"], 0.0), r["open_ms"] + r["restore_ms"])
            series[f"total_{key}"] = [totals[k] for k in sorted(totals)]
        floors = {"read": h.median(series["floor_read"]), "segment": h.median(series["floor_segment"])}
        for key, label, floor in ROWS:
            med = h.median(series[key])
            rows.append({"ranks": ranks, "key": key, "what": label, "median_ms": med,
                         "x_floor": med / floors[floor] if floor else None,
                         "x_read": med / floors["read"] if floor and key != "floor_read" else None,
                         "runs_ms": ", ".join(f"{x:.0f}" for x in series[key]),
                         "foreign_cpu_pct": max((r.get("foreign_cpu_pct", 0.0) for r in runs
                                                 if r["ranks"] == ranks and r["case"] == CASE_OF[key]), default=None)})
        pending = [r["pending"] for r in runs if r["ranks"] == ranks and r["case"] == "open_kept"]
        rows[-1]["pending"] = f"{sum(pending)}/{len(pending)}"
    return rows


TARGETS = [  # (what, numerator row, denominator row, at most)
    ("open finding a kept snapshot / open finding none", "open_kept", "open_empty", 1.0),
    ("open + restore from memory / segment copy floor", "total_memory", "floor_segment", 1.2),
    ("open + restore from memory / open + restore from storage", "total_memory", "total_storage", 1.0),
    ("open + restore from storage / readinto floor", "total_storage", "floor_read", 1.5),
]


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for ranks in sorted({r["ranks"] for r in rows}):
        row = {r["key"]: r for r in rows if r["ranks"] == ranks}
        for what, top, bottom, most in TARGETS:
            ratio = row[top]["median_ms"] / row[bottom]["median_ms"]
            out.append({"ranks": ranks, "what": what, "ratio": ratio, "target": f"<= {most:g}",
                        "holds": "yes" if ratio <= most else "no"})
    return out


def print_report(result: dict[str, Any]) -> None:
    print(h.markdown_table(result["rows"], COLUMNS))
    print()
    print(h.markdown_table(targets(result["rows"]), [("ranks", "ranks", 0), ("what", "ratio of medians", 0),
                                                     ("ratio", "this run", 2), ("target", "target", 0),
                                                     ("holds", "holds?", 0)]))
    for ranks in sorted({r["ranks"] for r in result["rows"]}):
        pending = next(r["pending"] for r in result["rows"] if r["ranks"] == ranks and "pending" in r)
        print(f"\n{ranks} rank(s): kept records found pending at the open (of every rank's): {pending}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="state size per process (params + 2 Adam moments)")
    p.add_argument("--repeats", type=int, default=5, help="rounds; each runs every case once, in a rotated order")
    p.add_argument("--ranks", dest="ranks_list", default="1,2", help="comma list: 1 (a process) and job sizes")
    p.add_argument("--dir", default=None, help="where the roots are written once and reused (default: "
                                               "bench/results/open_kept_<gib>gib)")
    p.add_argument("--pythonpath", default=None, help="measure the mpckpt of this checkout")
    p.add_argument("--out", default=os.path.join(h.RESULTS_DIR, "open_kept.json"))
    p.add_argument("--wait-quiet-s", type=float, default=10,
                   help="before each case, wait up to this long for other processes to leave the CPUs idle")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--ranks-child", dest="ranks", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.dir = os.path.abspath(args.dir or os.path.join(h.RESULTS_DIR, f"open_kept_{args.gib:g}gib"))
    return args


def main() -> None:
    args = parse_args()
    if args.child:
        h.emit_result(child(args))
        return
    import compileall

    checkout = os.path.abspath(args.pythonpath or h.REPO_DIR)
    if args.pythonpath:  # the children's mpckpt, and this process's (finding what they kept)
        os.environ["PYTHONPATH"] = checkout
        sys.path.insert(0, checkout)
    compileall.compile_dir(os.path.join(checkout, "mpckpt"), quiet=1)  # as an installed package has it
    print("command: " + " ".join([os.path.relpath(sys.executable, h.REPO_DIR), *sys.argv]), flush=True)
    try:
        result = measure(args)
    finally:
        ranks = [int(x) for x in args.ranks_list.split(",") if x.strip()]
        gone = h.remove_kept_in_memory([roots(args.dir, r)[1] for r in ranks], ranks=range(max(ranks)))
        if gone:
            print(f"removed the snapshots kept in memory: {', '.join(gone)}", file=sys.stderr)
    result["targets"] = targets(result["rows"])
    h.write_json(args.out, result)
    print_report(result)
    print(f"\nresults: {args.out}")


if __name__ == "__main__":
    main()
