"""What a restarted trainer pays before its first step, phase by phase, against the peers' restores.

Every repetition is a fresh process (a restart): it imports torch, builds the house workload's
model and a fresh Adam (``_harness``: ``nn.Linear`` layers, ``--gib`` GiB with the moments), then
restores one committed checkpoint of the same state, written once into ``--dir`` by a child.
``--moments fresh`` (the default) is a restarted trainer: its optimizer has no state yet, so the
moments (two thirds of the bytes) need new memory, whose pages the kernel must allocate and zero
as they are first written; ``--moments live`` steps the optimizer once (zero gradients) before
the clock, so every tensor exists and is touched (a restore inside a running process).

- ``readinto floor``: the checkpoint's shard bytes read into one preallocated, touched buffer of
  their size with 64 MiB ``preadv`` calls on 2 threads; no hash, nothing applied (the floor);
- ``restart floor``: the same reads into the memory a restarted trainer has: a touched buffer of
  the size of the model's parameters (of the whole state with ``--moments live``), then new
  memory (``torch.empty``, its pages first written by the reads) for the rest: the physical floor
  of a restore into a fresh optimizer;
- ``torch.load``: ``torch.load`` of a ``torch.save`` file of the state dicts, then
  ``load_state_dict`` on the model and the optimizer;
- ``DCP load``: ``dcp.load`` of a ``dcp.save`` of ``get_state_dict``, then ``set_state_dict``;
- ``mpckpt read-only``: ``Checkpointer(root, read_only=True)`` and ``restore`` (open, read,
  verify, apply);
- ``mpckpt writer``: what a restarted trainer runs: ``Checkpointer(root)`` (lock, recovery scan,
  uploaders), ``restore`` (which also prepares shared memory for the next save), and, timed
  apart, ``close``;
- ``segment copy``: the bytes of the snapshot kept in /dev/shm (``keep_in_memory``) copied from
  a read-only map of its data file into one preallocated, touched buffer of their size, with
  ``memmove`` of two halves on 2 threads; no hash, nothing applied (the floor of a restore from
  memory);
- ``mpckpt memory``: the writer's restart when a snapshot of the state is kept in this node's
  memory: as ``mpckpt writer``, on a root whose only checkpoint is a ``mode="memory"`` save kept
  in /dev/shm (asserting ``last_restore.source == "memory"``), closed with
  ``leave_in_memory=True`` so the next repetition finds it again (a memory-only step stays kept
  after its restore).

Subjects run interleaved (drift hits each alike), warm page cache (one untimed read first), and
``--pythonpath`` measures another checkout's mpckpt. Figures are medians; ``x floor`` is the
restore's median over the readinto floor's, ``x restart floor`` over the restart floor's, ``x
segment copy`` over the segment copy's. The time to build the model is reported, not counted;
nor is importing torch, or mpckpt (``import s``, reported apart: paid by every process that uses
mpckpt, at its start, whether or not it restores; the bench compiles mpckpt's bytecode first, as
an installed package has it, since ``PYTHONDONTWRITEBYTECODE`` set in an environment would
otherwise make every import compile from source). The kept snapshot is written when a subject
needs it and removed at the end (it holds the state's size in /dev/shm while the subjects run: at
large sizes, run the memory subjects apart from those that hold two copies of the state, with
``--subjects``). ``mpckpt gc`` run
meanwhile by this user on this node removes it between repetitions (no process keeps it then),
and the memory subject fails its assertion: run the bench where nobody runs ``gc``.

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
MEM_ROOT = "mpckpt_mem"  # the root whose only checkpoint is kept in memory
SUBJECTS = ["floor", "restart_floor", "torch_load", "dcp_load", "mpckpt_read_only", "mpckpt_writer", "segment_copy",
            "mpckpt_memory"]
MEMORY_SUBJECTS = {"segment_copy", "mpckpt_memory"}  # need the snapshot kept in /dev/shm
LABELS = {"floor": "readinto floor (2 threads, no hash)",
          "restart_floor": "restart floor (readinto the trainer's memory, 2 threads, no hash)",
          "torch_load": "torch.load + load_state_dict",
          "dcp_load": "DCP load + set_state_dict", "mpckpt_read_only": "mpckpt read-only: open + restore",
          "mpckpt_writer": "mpckpt writer: open + restore (+ prepare)",
          "segment_copy": "segment copy floor (kept in /dev/shm, 2 threads, no hash)",
          "mpckpt_memory": "mpckpt writer from memory: open + restore (+ prepare)"}
COLUMNS = [("what", "what", 0), ("median_s", "to a usable model s", 3), ("x_floor", "x floor", 1),
           ("x_restart", "x restart floor", 1), ("x_segment", "x segment copy", 1),
           ("import_s", "import s", 3), ("open_s", "open s", 3), ("restore_s", "restore s", 3),
           ("close_s", "close s", 3),
           ("build_s", "build model s", 2), ("runs_s", "runs s", 0)]


def _live(gib: float, moments: str = "fresh") -> tuple[Any, Any]:
    """A restarted trainer's model and optimizer: built anew, the optimizer without state yet
    (``moments="live"``: stepped once with zero gradients, so that its moments exist)."""
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
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-5)
    if moments == "live":
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def write_child(folder: str, gib: float, *, storage: bool, memory: bool) -> None:
    """Write what is missing: the storage checkpoints (step 1: mpckpt, torch.save, DCP), and the
    snapshot of step 2 kept in memory only, for the root ``MEM_ROOT`` (left for the next process)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import mpckpt

    work = h.build_workload(gib)
    if storage:
        with mpckpt.Checkpointer(os.path.join(folder, "mpckpt"), workers=2) as ckpt:
            ckpt.save(1, {"model": work.model, "optim": work.optimizer}, mode="sync")
        torch.save({"model": work.model.state_dict(), "optim": work.optimizer.state_dict()},
                   os.path.join(folder, "state.pt"))
        model_sd, optim_sd = get_state_dict(work.model, work.optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(folder, "dcp"))
    if memory:
        # a budget of one slab: the default (half of available memory) is less than that at 8 GiB
        budget = h.state_bytes(h.state_tensors(work)) * 11 // 10 + (64 << 20)
        ckpt = mpckpt.Checkpointer(os.path.join(folder, MEM_ROOT), workers=2, keep_in_memory=True,
                                   memory_budget=budget)
        ckpt.save(2, {"model": work.model, "optim": work.optimizer}, mode="memory")
        ckpt.close(leave_in_memory=True)
    h.emit_result({"written": folder})


def child(subject: str, folder: str, gib: float, moments: str) -> None:
    import torch  # (imported with _harness already: not timed)

    out: dict[str, Any] = {}
    if subject in ("floor", "segment_copy"):
        out.update(_floor(os.path.join(folder, "mpckpt")) if subject == "floor"
                   else _segment_copy(os.path.join(folder, MEM_ROOT)))
        h.emit_result(out)
        return
    if subject.startswith("mpckpt"):
        started = time.perf_counter()
        import mpckpt.checkpointer  # noqa: F401  (what Checkpointer's first use imports)
        out["import_s"] = time.perf_counter() - started
    built = time.perf_counter()
    model, optimizer = _live(gib, moments)
    if subject == "restart_floor":
        out.update(_restart_floor(os.path.join(folder, "mpckpt"), model, optimizer))
        h.emit_result(out)
        return
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

        memory = subject == "mpckpt_memory"
        opened = time.perf_counter()
        ckpt = mpckpt.Checkpointer(os.path.join(folder, MEM_ROOT if memory else "mpckpt"),
                                   read_only=subject == "mpckpt_read_only")
        t1 = time.perf_counter()
        step = ckpt.restore({"model": model, "optim": optimizer})
        t2 = time.perf_counter()
        assert step == (2 if memory else 1), step
        restored = ckpt.last_restore
        assert restored is not None
        if memory:
            assert restored.source == "memory", f"restored step {step} from {restored.source}, not from memory"
        out.update(open_s=t1 - opened, restore_s=t2 - t1, source=restored.source, bytes=restored.bytes)
        ckpt.close(leave_in_memory=memory)  # the next repetition restores it again
        out["close_s"] = time.perf_counter() - t2
    out["total_s"] = out.get("open_s", 0.0) + out["restore_s"]
    h.emit_result(out)


def _shards(root: str) -> tuple[list[str], int]:
    """The shard files of the newest checkpoint in ``root``, and their total size."""
    folder = os.path.join(root, sorted(n for n in os.listdir(root) if n.startswith("step_"))[-1])
    paths = [os.path.join(folder, n) for n in sorted(os.listdir(folder)) if n.endswith(".safetensors")]
    return paths, sum(os.path.getsize(p) for p in paths)


def _bytes_of(t: Any) -> memoryview:
    """A writable byte view of tensor ``t``'s memory."""
    import ctypes

    return memoryview((ctypes.c_char * t.numel()).from_address(t.data_ptr())).cast("B")


def _floor(root: str) -> dict[str, Any]:
    import torch

    paths, total = _shards(root)
    buffer = torch.ones(total, dtype=torch.uint8)  # touched, as live tensors are
    seconds = h.read_files_into(paths, _bytes_of(buffer), threads=2, chunk=CHUNK)
    return {"restore_s": seconds, "total_s": seconds, "bytes": total}


def _restart_floor(root: str, model: Any, optimizer: Any) -> dict[str, Any]:
    """The floor's reads into what a restarted trainer holds: touched memory the size of the tensors
    that exist (the model's; the moments too once stepped), new memory for the rest."""
    import torch

    paths, total = _shards(root)
    existing = sum(p.nbytes for p in model.parameters())
    existing += sum(t.nbytes for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor))
    touched = torch.ones(min(existing, total), dtype=torch.uint8)
    started = time.perf_counter()
    fresh = torch.empty(total - touched.numel(), dtype=torch.uint8)  # pages come with the first write
    h.read_files_into(paths, [_bytes_of(t) for t in (touched, fresh) if t.numel()], threads=2, chunk=CHUNK)
    seconds = time.perf_counter() - started
    return {"restore_s": seconds, "total_s": seconds, "bytes": total, "fresh_bytes": fresh.numel()}


def _segment_copy(root: str) -> dict[str, Any]:
    """The kept snapshot's data file, mapped read-only, copied into a touched buffer by 2 threads."""
    import ctypes
    import mmap
    import threading

    import numpy as np
    import torch

    from mpckpt._keep.record import KeptRecord
    from mpckpt._keep.store import SHM_DIR, base_name, record_names

    base = base_name(os.path.abspath(root), 0)
    with open(os.path.join(SHM_DIR, record_names(base)[-1]), "rb") as f:
        record = KeptRecord.from_bytes(f.read(), path=f.name)
    spans = sorted((span.offset, span.nbytes) for span in record.spans.values())
    start = spans[0][0]
    total = max(offset + n for offset, n in spans) - start  # the shards' data lie in one stretch of the slab
    fd = os.open(os.path.join(SHM_DIR, record.data), os.O_RDONLY)
    try:
        data = mmap.mmap(fd, record.data_size, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)
    src = np.frombuffer(data, dtype=np.uint8)
    buffer = torch.ones(total, dtype=torch.uint8)  # touched, as live tensors are
    dst, at, half = buffer.data_ptr(), src.ctypes.data + start, total // 2
    parts = [(dst, at, half), (dst + half, at + half, total - half)]
    threads = [threading.Thread(target=ctypes.memmove, args=part) for part in parts]  # memmove releases the GIL
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - started
    del src
    data.close()
    return {"restore_s": seconds, "total_s": seconds, "bytes": total,
            "state_bytes": sum(n for _, n in spans), "slab_bytes": record.data_size}


def compile_mpckpt(pythonpath: str | None) -> None:
    """Write the bytecode of the mpckpt the children import, as an installed package has it."""
    import compileall

    package = os.path.join(os.path.abspath(pythonpath or os.path.join(os.path.dirname(__file__), "..")), "mpckpt")
    compileall.compile_dir(package, quiet=1)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    folder = os.path.abspath(args.dir or os.path.join(h.RESULTS_DIR, f"restore_time_ckpt_{args.gib:g}gib"))
    subjects = [s for s in args.subjects.split(",") if s]
    unknown = sorted(set(subjects) - set(SUBJECTS))
    if unknown:
        raise SystemExit(f"unknown subjects {unknown}; choose from {SUBJECTS}")
    mem_root = os.path.join(folder, MEM_ROOT)
    write(args, folder, storage=not os.path.exists(os.path.join(folder, "state.pt")),
          memory=bool(MEMORY_SUBJECTS & set(subjects)) and not h.kept_in_memory(mem_root))
    try:
        return _measure(args, folder, subjects)
    finally:
        for name in h.remove_kept_in_memory([mem_root, os.path.join(folder, "mpckpt")]):
            print(f"removed the snapshot kept in memory {name}", file=sys.stderr)


def write(args: argparse.Namespace, folder: str, *, storage: bool, memory: bool) -> None:
    """Run the write child for what is missing."""
    missing = [what for what, needed in (("storage", storage), ("memory", memory)) if needed]
    if not missing:
        return
    os.makedirs(folder, exist_ok=True)
    print(f"writing the {args.gib} GiB checkpoints ({', '.join(missing)}) into {folder} ...", file=sys.stderr)
    result = h.run_child([os.path.abspath(__file__), "--write", folder, "--write-what", ",".join(missing),
                          "--gib", str(args.gib)])
    if result.get("status") == "error":
        raise RuntimeError(f"writing the checkpoints failed: {result}")


def run_subject(args: argparse.Namespace, folder: str, subject: str) -> dict[str, Any]:
    """One repetition of ``subject`` in a fresh process. A memory subject whose kept snapshot is
    gone (``mpckpt gc`` run meanwhile on this node removes it) writes it again first, once."""
    argv = [os.path.abspath(__file__), "--child", subject, "--dir", folder, "--gib", str(args.gib),
            "--moments", args.moments]
    rewritten = 0
    for _ in range(2):
        if subject in MEMORY_SUBJECTS and not h.kept_in_memory(os.path.join(folder, MEM_ROOT)):
            print("the snapshot kept in memory is gone (removed by `mpckpt gc`?): writing it again", file=sys.stderr)
            write(args, folder, storage=False, memory=True)
            rewritten += 1
        result = h.run_child(argv)
        if result.get("status") != "error":
            return {**result, "kept_rewritten": rewritten}
        if subject not in MEMORY_SUBJECTS or h.kept_in_memory(os.path.join(folder, MEM_ROOT)):
            break
    raise RuntimeError(f"{subject} failed: {result['error']}")


def _measure(args: argparse.Namespace, folder: str, subjects: list[str]) -> dict[str, Any]:
    h.warm_page_cache(folder)
    if args.pythonpath:
        os.environ["PYTHONPATH"] = os.path.abspath(args.pythonpath)
    compile_mpckpt(args.pythonpath)
    busy = h.wait_for_quiet(args.wait_quiet_s)
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in subjects}
    for _ in range(args.reps):
        for subject in subjects:
            runs[subject].append(run_subject(args, folder, subject))
    floors = {name: h.median([r["total_s"] for r in runs[name]]) if runs.get(name) else None
              for name in ("floor", "restart_floor", "segment_copy")}
    rows = []
    for subject, results in runs.items():
        med = h.median([r["total_s"] for r in results])

        def mid(key: str, results: list[dict[str, Any]] = results) -> float | None:
            return h.median([r[key] for r in results]) if key in results[0] else None

        segment = floors["segment_copy"] if subject in MEMORY_SUBJECTS else None
        rows.append({"what": LABELS[subject], "subject": subject, "median_s": med,
                     "x_floor": med / floors["floor"] if floors["floor"] else None,
                     "x_restart": med / floors["restart_floor"]
                     if floors["restart_floor"] and subject not in ("floor", "segment_copy") else None,
                     "import_s": mid("import_s"),
                     "x_segment": med / segment if segment else None,
                     "open_s": mid("open_s"), "restore_s": mid("restore_s"), "close_s": mid("close_s"),
                     "build_s": mid("build_s"), "source": results[0].get("source"), "bytes": results[0].get("bytes"),
                     "runs_s": ", ".join(f"{r['total_s']:.2f}" for r in results),
                     "peak_mib_max": max(r.get("peak_mib", 0.0) for r in results),
                     "kept_rewritten": sum(r.get("kept_rewritten", 0) for r in results),
                     "foreign_cpu_pct_max": max(r.get("foreign_cpu_pct", 0.0) for r in results)})
    return {"benchmark": "restore_time", "args": vars(args), "folder": folder, "machine": h.machine_info(),
            "rows": rows, "busy_before_pct": busy}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="state size (params + 2 Adam moments) written the first time")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--subjects", default=",".join(SUBJECTS), help="comma list; default all")
    p.add_argument("--dir", default=None,
                   help="where the checkpoints are written once and reused (default: bench/results/"
                        "restore_time_ckpt_<gib>gib)")
    p.add_argument("--pythonpath", default=None, help="measure the mpckpt of this checkout")
    p.add_argument("--moments", choices=("fresh", "live"), default="fresh",
                   help="fresh: the optimizer has no state yet (a restart); live: stepped once before the clock")
    p.add_argument("--out", default=os.path.join(h.RESULTS_DIR, "restore_time.json"))
    p.add_argument("--wait-quiet-s", type=float, default=20, help="wait up to this long for idle CPUs first")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--write", default=None, help=argparse.SUPPRESS)
    p.add_argument("--write-what", default="storage,memory", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.child:
        return child(args.child, args.dir, args.gib, args.moments)
    if args.write:
        what = args.write_what.split(",")
        return write_child(args.write, args.gib, storage="storage" in what, memory="memory" in what)
    result = measure(args)
    print(h.markdown_table(result["rows"], COLUMNS))
    h.write_json(args.out, result)
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
