"""What a restarted trainer pays before its first step, phase by phase, against the peers' restores.

Every repetition is a fresh process (a restart): it imports torch, builds the house workload's
model and a fresh Adam (``_harness``: ``nn.Linear`` layers, ``--gib`` GiB with the moments), then
restores one committed checkpoint of the same state, written once into ``--dir`` by a child:

- ``readinto floor``: the checkpoint's shard bytes read into one preallocated, touched buffer of
  their size with 64 MiB ``preadv`` calls on 2 threads; no hash, nothing applied (the floor);
- ``torch.load``: ``torch.load`` of a ``torch.save`` file of the state dicts, then
  ``load_state_dict`` on the model and the optimizer;
- ``DCP load``: ``dcp.load`` of a ``dcp.save`` of ``get_state_dict``, then ``set_state_dict``;
- ``mpckpt read-only``: ``Checkpointer(root, read_only=True)`` and ``restore`` (open, read,
  verify, apply);
- ``mpckpt writer``: what a restarted trainer runs: ``Checkpointer(root)`` (lock, recovery scan,
  uploaders), ``restore`` (which also prepares shared memory for the next save), and, timed
  apart, ``close``.

Subjects run interleaved (drift hits each alike), warm page cache (one untimed read first), and
``--pythonpath`` measures another checkout's mpckpt. Figures are medians; ``x floor`` is the
restore's median over the floor's. The time to build the model is reported, not counted (nor is
importing torch, done before any clock starts).

    .venv/bin/python bench/restore_time.py --gib 1 --reps 3
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import _harness as h

CHUNK = 64 << 20
SUBJECTS = ["floor", "torch_load", "dcp_load", "mpckpt_read_only", "mpckpt_writer"]
LABELS = {"floor": "readinto floor (2 threads, no hash)", "torch_load": "torch.load + load_state_dict",
          "dcp_load": "DCP load + set_state_dict", "mpckpt_read_only": "mpckpt read-only: open + restore",
          "mpckpt_writer": "mpckpt writer: open + restore (+ prepare)"}
COLUMNS = [("what", "what", 0), ("median_s", "to a usable model s", 3), ("x_floor", "x floor", 1),
           ("open_s", "open s", 3), ("restore_s", "restore s", 3), ("close_s", "close s", 3),
           ("build_s", "build model s", 2), ("runs_s", "runs s", 0)]


def _live(gib: float) -> tuple[Any, Any]:
    """A restarted trainer's model and optimizer: built anew, the optimizer without state yet."""
    import torch
    from torch import nn

    torch.manual_seed(1)
    layers = h.layers_for(gib, 2048)
    blocks: list[nn.Module] = []
    for i in range(layers):
        blocks.append(nn.Linear(2048, 2048))
        if i < layers - 1:
            blocks.append(nn.ReLU())
    model = nn.Sequential(*blocks)
    return model, torch.optim.Adam(model.parameters(), lr=1e-5)


def write_child(folder: str, gib: float) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import mpckpt

    work = h.build_workload(gib)
    with mpckpt.Checkpointer(os.path.join(folder, "mpckpt"), workers=2) as ckpt:
        ckpt.save(1, {"model": work.model, "optim": work.optimizer}, mode="sync")
    torch.save({"model": work.model.state_dict(), "optim": work.optimizer.state_dict()},
               os.path.join(folder, "state.pt"))
    model_sd, optim_sd = get_state_dict(work.model, work.optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(folder, "dcp"))
    h.emit_result({"written": folder})


def child(subject: str, folder: str, gib: float) -> None:
    import torch  # (imported with _harness already: not timed)

    out: dict[str, Any] = {}
    if subject == "floor":
        out.update(_floor(os.path.join(folder, "mpckpt")))
        h.emit_result(out)
        return
    built = time.perf_counter()
    model, optimizer = _live(gib)
    t0 = time.perf_counter()
    out["build_s"] = t0 - built
    if subject == "torch_load":
        loaded = torch.load(os.path.join(folder, "state.pt"), weights_only=True)
        model.load_state_dict(loaded["model"])
        optimizer.load_state_dict(loaded["optim"])
        out["restore_s"] = time.perf_counter() - t0
    elif subject == "dcp_load":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(folder, "dcp"))  # in place
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
        out["restore_s"] = time.perf_counter() - t0
    else:
        import mpckpt

        opened = time.perf_counter()
        ckpt = mpckpt.Checkpointer(os.path.join(folder, "mpckpt"), read_only=subject == "mpckpt_read_only")
        t1 = time.perf_counter()
        step = ckpt.restore({"model": model, "optim": optimizer})
        t2 = time.perf_counter()
        assert step == 1, step
        out.update(open_s=t1 - opened, restore_s=t2 - t1)
        ckpt.close()
        out["close_s"] = time.perf_counter() - t2
    out["total_s"] = out.get("open_s", 0.0) + out["restore_s"]
    h.emit_result(out)


def _floor(root: str) -> dict[str, Any]:
    import ctypes

    import torch

    folder = os.path.join(root, sorted(n for n in os.listdir(root) if n.startswith("step_"))[-1])
    paths = [os.path.join(folder, n) for n in sorted(os.listdir(folder)) if n.endswith(".safetensors")]
    total = sum(os.path.getsize(p) for p in paths)
    buffer = torch.ones(total, dtype=torch.uint8)  # touched, as live tensors are
    view = memoryview((ctypes.c_char * total).from_address(buffer.data_ptr())).cast("B")
    seconds = h.read_files_into(paths, view, threads=2, chunk=CHUNK)
    return {"restore_s": seconds, "total_s": seconds, "bytes": total}


def warm(folder: str) -> None:
    for dirpath, _, files in os.walk(folder):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                while f.read(CHUNK):
                    pass


def measure(args: argparse.Namespace) -> dict[str, Any]:
    folder = os.path.abspath(args.dir)
    if not os.path.exists(os.path.join(folder, "state.pt")):
        os.makedirs(folder, exist_ok=True)
        print(f"writing the {args.gib} GiB checkpoints into {folder} (once) ...", file=sys.stderr)
        result = h.run_child([os.path.abspath(__file__), "--write", folder, "--gib", str(args.gib)])
        if result.get("status") == "error":
            raise RuntimeError(f"writing the checkpoints failed: {result}")
    warm(folder)
    if args.pythonpath:
        os.environ["PYTHONPATH"] = os.path.abspath(args.pythonpath)
    subjects = [s for s in args.subjects.split(",") if s]
    busy = h.wait_for_quiet(args.wait_quiet_s)
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in subjects}
    for _ in range(args.reps):
        for subject in subjects:
            result = h.run_child([os.path.abspath(__file__), "--child", subject, "--dir", folder,
                                  "--gib", str(args.gib)])
            if result.get("status") == "error":
                raise RuntimeError(f"{subject} failed: {result['error']}")
            runs[subject].append(result)
    floor = h.median([r["total_s"] for r in runs["floor"]]) if runs.get("floor") else None
    rows = []
    for subject, results in runs.items():
        med = h.median([r["total_s"] for r in results])

        def mid(key: str, results: list[dict[str, Any]] = results) -> float | None:
            return h.median([r[key] for r in results]) if key in results[0] else None

        rows.append({"what": LABELS[subject], "median_s": med, "x_floor": med / floor if floor else None,
                     "open_s": mid("open_s"), "restore_s": mid("restore_s"), "close_s": mid("close_s"),
                     "build_s": mid("build_s"),
                     "runs_s": ", ".join(f"{r['total_s']:.2f}" for r in results),
                     "foreign_cpu_pct_max": max(r.get("foreign_cpu_pct", 0.0) for r in results)})
    return {"benchmark": "restore_time", "args": vars(args), "machine": h.machine_info(), "rows": rows,
            "busy_before_pct": busy}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="state size (params + 2 Adam moments) written the first time")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--subjects", default=",".join(SUBJECTS), help="comma list; default all")
    p.add_argument("--dir", default=os.path.join(h.RESULTS_DIR, "restore_time_ckpt"),
                   help="where the checkpoints are written once and reused")
    p.add_argument("--pythonpath", default=None, help="measure the mpckpt of this checkout")
    p.add_argument("--out", default=os.path.join(h.RESULTS_DIR, "restore_time.json"))
    p.add_argument("--wait-quiet-s", type=float, default=20, help="wait up to this long for idle CPUs first")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--write", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.child:
        return child(args.child, args.dir, args.gib)
    if args.write:
        return write_child(args.write, args.gib)
    result = measure(args)
    print(h.markdown_table(result["rows"], COLUMNS))
    h.write_json(args.out, result)
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
