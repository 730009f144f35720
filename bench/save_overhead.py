"""What ``save()`` costs the training thread beyond the bare copy, per state shape, against DCP.

For each state shape (``--shapes``), in a fresh subprocess, every mode of ``--modes`` on the same
tensors:

  floor    a bare ``copy_`` of every tensor into preallocated, pre-touched shared memory; with
           ``floor`` among the modes, the same copy is also made right before every timed save
           of eager, unkept and overlap, and each of them is given against those copies (the
           ratio of the medians): this machine's copy speed drifts between processes and over
           minutes (61-114 ms for the same 1 GiB), and a save is compared with copies a moment
           apart from it, never with copies made in another phase of the run
  eager    ``Checkpointer(dir, workers=2)``, ``prepare(state)`` first, then ``--saves`` ASYNC
           saves, each timed from the call to its return; the previous save's commit, its
           keeping in memory, retention's deletes and the kernel's writeback of its files
           (``os.sync``) are waited for *outside* the timing, so nothing of it runs while a save
           is timed and what is measured is the save path itself (flatten, layout, ledger
           record, copy, jobs), in the conditions the floor is measured in
  unkept   eager with ``keep_in_memory=False``: no snapshot kept in memory for a restart, so
           no hash of it as it is copied and no record (what the recovery tier costs a save)
  overlap  the same with ``overlap=True`` (the copy of parameters and optimizer state runs in the
           background; what is timed is what the loop waits for in ``save``)
  cold     a fresh ``Checkpointer`` with neither ``prepare`` nor ``restore``: its first save makes
           its shared memory (timed after the uploaders are up: ``wait()``), then steady saves
  dcp      ``torch.distributed.checkpoint.async_save`` with its default stager (``DefaultStager``,
           shared memory, cached between saves), a one-rank gloo group: the first save and steady
           ones (``get_state_dict`` + ``async_save``; the previous upload waited for outside)

Shapes: ``COUNTxSIZE`` (a dict of float32 tensors: ``16x64MiB``, ``100000x1KiB``), ``model``
(blocks of ``Linear(512, 512)`` + ``LayerNorm(512)`` and Adam: about 700 modules, 1,400
parameters, 5,600 tensors in ``--gib`` GiB, a real model's shape), ``mixed`` (the same blocks in
bfloat16 with a float32 master copy, Adam over the master copy, int64 counters and BatchNorm's
``num_batches_tracked``). ``--pythonpath`` runs the children with another checkout (before/after
in one run, alternating, so this machine's drift hits both alike):

    .venv/bin/python bench/save_overhead.py --repeats 2
    .venv/bin/python bench/save_overhead.py --pythonpath /tmp/before --label before --repeats 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

import _harness as h

SHAPES = ["16x64MiB", "model", "100000x1KiB", "mixed"]
MODES = ["floor", "eager", "unkept", "overlap", "cold", "dcp"]
UNITS = {"KiB": 1 << 10, "MiB": 1 << 20}


def parse_shape(shape: str) -> tuple[int, int]:
    count, size = shape.split("x")
    for unit, factor in UNITS.items():
        if size.endswith(unit):
            return int(count), int(size[: -len(unit)]) * factor
    return int(count), int(size)


def build(shape: str, gib: float) -> tuple[dict[str, Any], Any]:
    """The state of ``shape`` (what ``save`` is given) and its state dicts (what DCP is given)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    if shape not in ("model", "mixed"):
        count, nbytes = parse_shape(shape)
        state: dict[str, Any] = {f"layer{i}": torch.randn(nbytes // 4) for i in range(count)}
        return state, lambda: dict(state)
    hidden = 512
    per_block = (hidden * hidden + 3 * hidden) * (4 * 3 if shape == "model" else 2 + 4 * 3)
    blocks = max(1, round(gib * h.GIB / per_block))
    norm = nn.LayerNorm if shape == "model" else nn.BatchNorm1d
    model = nn.Sequential(*[m for _ in range(blocks) for m in (nn.Linear(hidden, hidden), norm(hidden))])
    if shape == "model":
        opt = torch.optim.Adam(model.parameters(), lr=1e-5)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        state = {"model": model, "optim": opt}

        def dcp_model() -> Any:
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model_sd, optim_sd = get_state_dict(model, opt)
            return {"model": model_sd, "optim": optim_sd}

        return state, dcp_model
    model = model.to(torch.bfloat16)
    master = nn.ParameterList([nn.Parameter(p.detach().float()) for p in model.parameters()])
    opt = torch.optim.Adam(master.parameters(), lr=1e-5)
    for p in master.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    counters = {f"block{i}": torch.tensor(i, dtype=torch.int64) for i in range(blocks)}
    state = {"model": model, "master": master, "optim": opt, "counters": counters}
    return state, lambda: {"model": model.state_dict(), "master": master.state_dict(),
                           "optim": opt.state_dict(), "counters": dict(counters)}


def tensors_of(value: Any) -> list[Any]:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, torch.optim.Optimizer):
        return [t for s in value.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    if isinstance(value, torch.nn.Module):
        return list(value.state_dict().values())
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_of(v)]
    return []


def _timed_saves(ckpt: Any, state: dict[str, Any], saves: int, floor: Any = None) -> tuple[list[float], list[float]]:
    """The milliseconds of each save, and of the floor's copy made right before it (``floor``
    given: the copy and the save it is compared with see the same machine, a moment apart)."""
    out, floors = [], []
    for step in range(saves):
        if floor is not None:
            floors.append(floor.copy())
        started = time.perf_counter()
        future = ckpt.save(step, state)
        out.append((time.perf_counter() - started) * 1e3)
        future.result(600)  # not timed: the next save starts with nothing of this one in flight:
        ckpt.wait(600)      # its upload, its keeping in memory, retention's deletes,
        os.sync()           # and the kernel's writeback of the files it wrote
    return out, floors


def _dcp(state_dicts: Any, root: str, saves: int) -> list[float]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1)
    accel = torch.cuda.is_available()
    stager = DefaultStager(StagingOptions(use_pinned_memory=accel, use_shared_memory=True,
                                          use_async_staging=accel, use_non_blocking_copy=accel))
    out, future = [], None
    try:
        for step in range(saves):
            if future is not None:
                getattr(future, "upload_completion", future).result()  # not timed (as mpckpt's saves)
                os.sync()
            started = time.perf_counter()
            future = dcp.async_save(state_dicts(), checkpoint_id=os.path.join(root, f"dcp-{step}"), async_stager=stager)
            if hasattr(future, "staging_completion"):
                future.staging_completion.result()
            out.append((time.perf_counter() - started) * 1e3)
        getattr(future, "upload_completion", future).result()
    finally:
        stager.close()
    return out


def child(shape: str, saves: int, modes: list[str], gib: float) -> dict[str, Any]:
    import mpckpt

    state, state_dicts = build(shape, gib)
    tensors = tensors_of(state)
    result: dict[str, Any] = {"shape": shape, "tensors": len(tensors), "bytes": h.state_bytes(tensors),
                              "mpckpt": mpckpt.__file__}
    floor = h.ShmFloor(tensors) if "floor" in modes else None
    with tempfile.TemporaryDirectory(dir=h.RESULTS_DIR) as root:
        for mode in modes:
            if mode == "floor":
                result["floor_ms"] = [floor.copy() for _ in range(saves)]
            elif mode in ("eager", "unkept", "overlap"):
                with mpckpt.Checkpointer(os.path.join(root, mode), workers=2, keep_last=1,
                                         overlap=mode == "overlap", keep_in_memory=mode != "unkept") as ckpt:
                    ckpt.prepare(state)
                    result[f"{mode}_ms"], result[f"{mode}_floor_ms"] = _timed_saves(ckpt, state, saves, floor)
            elif mode == "cold":
                with mpckpt.Checkpointer(os.path.join(root, mode), workers=2, keep_last=1) as ckpt:
                    ckpt.wait()  # the uploaders are up, as after a script's first steps
                    result["cold_ms"] = _timed_saves(ckpt, state, saves)[0]
            elif mode == "dcp":
                try:
                    result["dcp_ms"] = _dcp(state_dicts, root, saves)
                except Exception as e:  # noqa: BLE001  (reported, not fatal: a DCP that cannot take this state)
                    result["dcp_error"] = f"{type(e).__name__}: {e}"[:300]
    return result


def _p50(values: list[float] | None) -> float | None:
    return statistics.median(values) if values else None


def _p90(values: list[float] | None) -> float | None:
    return h.percentile(values, 90) if values else None


def _row(r: dict[str, Any], label: str) -> str:
    every_floor = [v for key in ("floor_ms", "eager_floor_ms", "unkept_floor_ms", "overlap_floor_ms")
                   for v in r.get(key) or []]
    floor = _p50(every_floor)
    cold, dcp = r.get("cold_ms") or [], r.get("dcp_ms") or []

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:,.1f}"

    def x(v: float | None, base: float | None) -> str:
        return "-" if v is None or not base else f"{v / base:.2f}x"

    def paired(mode: str) -> str:  # the saves against the floor's copies made right before them
        saved = _p50(r.get(f"{mode}_ms"))
        return f"{ms(saved)} ({x(saved, _p50(r.get(f'{mode}_floor_ms')) or floor)})"

    def tail(mode: str) -> str:  # the p90 of the saves against the p90 of the floor's copies beside them
        saved = _p90(r.get(f"{mode}_ms"))
        return f"{ms(saved)} ({x(saved, _p90(r.get(f'{mode}_floor_ms')) or _p90(every_floor))})"

    return (f"| {label} | {r['shape']} | {r['tensors']:,} | {r['bytes'] / h.MIB:,.0f} | {ms(floor)} | {paired('eager')} "
            f"| {tail('eager')} "
            f"| {paired('unkept')} | {paired('overlap')} | {ms(cold[0] if cold else None)} | "
            f"{ms(_p50(cold[1:]))} | {ms(dcp[0] if dcp else None)} | {ms(_p50(dcp[1:]))} | "
            f"{x(cold[0] if cold else None, dcp[0] if dcp else None)} | {r.get('foreign_cpu_pct', '-')} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma list of COUNTxSIZE, model, mixed")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--gib", type=float, default=1.0, help="size of the model and mixed states")
    p.add_argument("--saves", type=int, default=8)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--pythonpath", default=None, help="a checkout whose mpckpt the children import")
    p.add_argument("--label", default="this checkout")
    p.add_argument("--sample-ms", type=float, default=1000.0,
                   help="how often the child's memory is sampled (its smaps are read: every 20 ms that takes a "
                        "share of a core and of the child's page tables, and the table reports no memory)")
    p.add_argument("--out", default=os.path.join(h.RESULTS_DIR, "save_overhead.json"))
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if args.child:
        h.emit_result(child(args.child, args.saves, modes, args.gib))
        return
    os.makedirs(h.RESULTS_DIR, exist_ok=True)
    rows = h.run_each(__file__, args.shapes.split(","), ["--saves", str(args.saves), "--modes", ",".join(modes),
                                                          "--gib", str(args.gib)],
                      label=args.label, repeats=args.repeats, pythonpath=args.pythonpath, sample_ms=args.sample_ms)
    h.write_json(args.out, {"benchmark": "save_overhead", "args": vars(args), "machine": h.machine_info(), "rows": rows})
    print("| checkout | shape | tensors | MiB | floor ms | eager ms (x paired floor) | eager p90 ms (x paired floor's p90) "
          "| unkept ms (x paired floor) | overlapped ms "
          "(x paired floor) | cold first ms | cold steady ms | DCP first ms | DCP steady ms | cold first / DCP first "
          "| other procs CPU % |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(_row(r, args.label))


if __name__ == "__main__":
    main()
