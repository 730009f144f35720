"""Persist throughput of mpckpt against a raw write of the same bytes to the same storage.

Raw write: ``--gib`` GiB from a preallocated, touched buffer into one file with a plain
``open(path, "wb").write(buffer)`` (one call: the same chunking as any plain write),
then ``fsync``; the time includes the fsync. For a URL (``--url``), the raw write is
``fsspec``'s ``open(url, "wb").write(buffer)`` with the same ``--storage-options``.

mpckpt: a state of the same bytes (``--tensors`` equal float32 tensors) saved ASYNC into
``Checkpointer(target, storage_options=...)``; its persist time is ``SaveFuture.stats.persist_ms``
(from the end of the snapshot to the commit: hashing, shard writes, fsyncs, manifest,
rename). Each repetition is awaited before the next and dirty pages are flushed between
runs, so both sides start from a clean page cache state. Figures are medians.

    .venv/bin/python bench/persist_throughput.py --gib 1 --reps 3
    .venv/bin/python bench/persist_throughput.py --gib 0.5 --url memory://bench
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import uuid
from typing import Any

import _harness as h
import torch

COLUMNS = [("what", "what", 0), ("mib", "MiB", 0), ("median_s", "median s", 3), ("mb_per_s", "MB/s", 0),
           ("runs_s", "runs s", 0)]


def raw_write_s(buffer: memoryview, target: str, options: dict[str, Any]) -> float:
    """Seconds to write ``buffer`` to a new file under ``target`` (a folder or a URL), fsync included."""
    name = f"raw-{uuid.uuid4().hex}.bin"
    if "://" not in target:
        path = os.path.join(target, name)
        started = time.perf_counter()
        with open(path, "wb") as f:
            f.write(buffer)
            f.flush()
            os.fsync(f.fileno())
        elapsed = time.perf_counter() - started
        os.unlink(path)
        return elapsed
    import fsspec

    fs, root = fsspec.core.url_to_fs(target, **options)
    path = f"{root.rstrip('/')}/{name}"
    started = time.perf_counter()
    with fs.open(path, "wb") as f:
        f.write(buffer)
    elapsed = time.perf_counter() - started
    fs.rm(path)
    return elapsed


def mpckpt_persist(state: dict[str, torch.Tensor], target: str, options: dict[str, Any],
                   args: argparse.Namespace) -> list[dict[str, Any]]:
    """Save ``state`` ``reps`` times; the stats of every save."""
    import mpckpt

    runs = []
    with mpckpt.Checkpointer(target, workers=args.workers, keep_last=1, storage_options=options) as ckpt:
        ckpt.prepare(state)
        for step in range(args.reps):
            h.sync_disk()
            future = ckpt.save(step, state)
            returned = time.perf_counter()
            future.result()
            runs.append({**future.stats.as_dict(), "return_to_commit_s": time.perf_counter() - returned})
    return runs


def measure(args: argparse.Namespace) -> dict[str, Any]:
    options = json.loads(args.storage_options) if args.storage_options else {}
    local = args.url is None
    folder, remove = h.target_dir(args.dir, "persist-") if local else (args.url, False)
    nbytes = int(args.gib * h.GIB) // (4 * args.tensors) * 4 * args.tensors
    state = {f"w{i:03d}": torch.randn(nbytes // 4 // args.tensors) for i in range(args.tensors)}
    buffer = torch.cat([t for t in state.values()]).numpy().data.cast("B")  # touched, same bytes
    busy = h.wait_for_quiet(args.wait_quiet_s)
    try:
        raw = []
        for _ in range(args.reps):
            h.sync_disk()
            raw.append(raw_write_s(buffer, folder, options))
        ckpt_dir = os.path.join(folder, "mpckpt") if local else f"{folder.rstrip('/')}/mpckpt"
        runs = mpckpt_persist(state, ckpt_dir, options, args)
    finally:
        if remove:
            shutil.rmtree(folder, ignore_errors=True)
    written = h.median([r["written_bytes"] for r in runs])
    persist_s = h.median([r["persist_ms"] / 1e3 for r in runs])
    raw_s = h.median(raw)
    rows = [
        {"what": "raw write + fsync", "mib": nbytes / h.MIB, "median_s": raw_s, "mb_per_s": nbytes / 1e6 / raw_s,
         "runs_s": ", ".join(f"{x:.2f}" for x in raw)},
        {"what": f"mpckpt persist ({args.workers} workers)", "mib": written / h.MIB, "median_s": persist_s,
         "mb_per_s": written / 1e6 / persist_s, "runs_s": ", ".join(f"{r['persist_ms'] / 1e3:.2f}" for r in runs)},
    ]
    return {"benchmark": "persist_throughput", "args": vars(args), "machine": h.machine_info(),
            "target": "local disk (same folder as the repository)" if local else args.url,
            "rows": rows, "ratio": rows[1]["mb_per_s"] / rows[0]["mb_per_s"], "mpckpt_runs": runs,
            "raw_runs_s": raw, "busy_before_pct": busy}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="bytes to write, in GiB")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--tensors", type=int, default=16, help="tensors the mpckpt state is split into")
    p.add_argument("--workers", type=int, default=2, help="mpckpt uploader processes")
    p.add_argument("--url", default=None, help="write to this URL instead of local disk (memory://, s3://, az://)")
    p.add_argument("--storage-options", default=None, help="JSON dict passed to fsspec / Checkpointer")
    p.add_argument("--dir", default=None, help="local target folder (default: a temporary one under bench/results/)")
    p.add_argument("--out", default=os.path.join(h.RESULTS_DIR, "persist_throughput.json"))
    p.add_argument("--wait-quiet-s", type=float, default=60,
                   help="first wait up to this long for other processes to leave the CPUs idle")
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    summary = measure(args)
    h.write_json(args.out, summary)
    print(h.markdown_table(summary["rows"], COLUMNS))
    print(f"\nmpckpt / raw: {summary['ratio']:.2f}\nresults: {args.out}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
