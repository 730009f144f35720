"""Which door to take: DCP's ``async_save`` into its FileSystemWriter, into mpckpt's ``StorageWriter``,
or mpckpt's own ``ckpt.save``, on the same FSDP2 loop under torchrun (gloo, CPU).

``bench/dist_fsdp.py``'s model and loop (``Loop``: ``--layers`` ``nn.Linear(--hidden, --hidden)``,
each layer and the root ``fully_shard``-ed, AdamW), in the same processes, ``--steps`` steps per
run and a save every ``--every``; runs in the order baseline, then ``--rounds`` x (every mode,
baseline). The modes:

  dcp_fs      ``dcp.async_save(get_state_dict(...), checkpoint_id=folder/step-N)``: DCP's
              FileSystemWriter, its default stager (``async_save`` makes one per save), the thread
              executor, on a gloo group of its own
  dcp_mpckpt  the same call with ``storage_writer=StorageWriter(ckpt, N)`` over one
              ``mpckpt.Checkpointer(folder, workers=--workers)`` per run
  mpckpt      ``ckpt.save(N, {"model": model, "optim": opt})``: mpckpt's own multi-rank path
              (``restore`` on the empty folder first, which makes its shared memory)

Every mode waits for the previous checkpoint before the next save (DCP allows one in flight).
Figures (a save as slow as its slower rank): blocked time per save on the training thread (the
wait for the previous one, ``get_state_dict`` and the call), loop time and its overhead against
the mean of the baselines around it, loop end -> durable, and then the load of the last step into
the same model: ``dcp.load`` + ``set_state_dict`` through FileSystemReader / ``StorageReader``,
``ckpt.restore`` for mpckpt (the files were just written: read from the page cache). The CPU the
whole machine used during each run is printed too (the VM is shared).

    .venv/bin/torchrun --standalone --nproc-per-node 2 bench/dcp_front_door.py
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import _harness as h
import psutil
import torch
import torch.distributed as dist
from dist_fsdp import Loop, dist_all_gather, dist_broadcast

MODES = ("dcp_fs", "dcp_mpckpt", "mpckpt")
COLUMNS = [
    ("mode", "mode", 0), ("saves", "saves", 0), ("blocked_p50_ms", "blocked p50 ms", 1),
    ("blocked_p90_ms", "blocked p90 ms", 1), ("first_save_ms", "first save ms", 1),
    ("loop_s", "loop s (per round)", 0), ("overhead_pct", "overhead % (per round)", 0),
    ("final_wait_s", "loop end -> durable s", 2), ("load_s", "load s (median)", 2),
    ("machine_busy_pct", "machine CPU busy %", 0),
]


class Door:
    """One way to checkpoint the loop: ``save``, ``finish`` (durable), ``load`` (the last step), ``close``."""

    def __init__(self, name: str, loop: Loop, folder: str, args: argparse.Namespace, group: Any) -> None:
        self.name, self.loop, self.folder, self.group = name, loop, folder, group
        self.future: Any = None
        self.last: int | None = None
        self.ckpt: Any = None
        if name != "dcp_fs":
            import mpckpt

            self.ckpt = mpckpt.Checkpointer(folder, workers=args.workers)
            if name == "mpckpt":
                self.ckpt.restore({"model": loop.model, "optim": loop.opt})

    def save(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        from mpckpt.integrations.dcp import StorageWriter

        self.last = step
        if self.name == "mpckpt":
            self.ckpt.save(step, {"model": self.loop.model, "optim": self.loop.opt})
            return
        if self.future is not None:
            self.future.result()
        model_sd, optim_sd = get_state_dict(self.loop.model, self.loop.opt)
        if self.name == "dcp_fs":
            self.future = dcp.async_save({"model": model_sd, "optim": optim_sd},
                                         checkpoint_id=os.path.join(self.folder, f"step-{step}"),
                                         process_group=self.group)
        else:
            self.future = dcp.async_save({"model": model_sd, "optim": optim_sd},
                                         storage_writer=StorageWriter(self.ckpt, step), process_group=self.group)

    def finish(self) -> None:
        if self.future is not None:
            self.future.result()
        if self.ckpt is not None:
            self.ckpt.wait()

    def load(self) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        from mpckpt.integrations.dcp import StorageReader

        if self.name == "mpckpt":
            self.ckpt.restore({"model": self.loop.model, "optim": self.loop.opt}, step=self.last)
            return
        model_sd, optim_sd = get_state_dict(self.loop.model, self.loop.opt)
        state = {"model": model_sd, "optim": optim_sd}
        if self.name == "dcp_fs":
            dcp.load(state, checkpoint_id=os.path.join(self.folder, f"step-{self.last}"), process_group=self.group)
        else:
            dcp.load(state, storage_reader=StorageReader(self.ckpt, self.last), process_group=self.group)
        set_state_dict(self.loop.model, self.loop.opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])

    def close(self) -> None:
        if self.ckpt is not None:
            self.ckpt.close()


def run(name: str, loop: Loop, folder: str, args: argparse.Namespace, group: Any) -> dict[str, Any]:
    if dist.get_rank() == 0:
        os.makedirs(folder, exist_ok=True)
    dist.barrier()
    door = Door(name, loop, folder, args, group) if name != "baseline" else None
    dist.barrier()
    psutil.cpu_percent(None)
    blocked: list[float] = []
    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        loop.step()
        if door is not None and step % args.every == 0:
            t0 = time.perf_counter()
            door.save(step)
            blocked.append((time.perf_counter() - t0) * 1e3)
    loop_end = time.perf_counter()
    load_s = None
    if door is not None:
        door.finish()
    durable = time.perf_counter()
    busy = psutil.cpu_percent(None)
    if door is not None:
        dist.barrier()
        t0 = time.perf_counter()
        door.load()
        load_s = time.perf_counter() - t0
        door.close()
    dist.barrier()
    return {"mode": name, "blocked_ms": blocked, "loop_s": loop_end - started, "final_wait_s": durable - loop_end,
            "load_s": load_s, "machine_busy_pct": busy}


def merge(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    out = dict(per_rank[0])
    out["blocked_ms"] = [round(max(x), 2) for x in zip(*(r["blocked_ms"] for r in per_rank), strict=True)]
    for key in ("loop_s", "final_wait_s", "load_s"):
        values = [r[key] for r in per_rank if r[key] is not None]
        out[key] = max(values) if values else None
    return out


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    baselines = [r["loop_s"] for r in runs if r["mode"] == "baseline"]
    rows: list[dict[str, Any]] = [{"mode": "baseline", "saves": 0, "loop_s": ", ".join(f"{b:.1f}" for b in baselines),
                                   "machine_busy_pct": h.median([r["machine_busy_pct"] for r in runs
                                                                 if r["mode"] == "baseline"])}]
    for name in MODES:
        mine = [(i, r) for i, r in enumerate(runs) if r["mode"] == name]
        if not mine:
            continue
        blocked = [b for _, r in mine for b in r["blocked_ms"]]
        overheads = []
        for i, r in mine:
            before = next(x["loop_s"] for x in reversed(runs[:i]) if x["mode"] == "baseline")
            after = next((x["loop_s"] for x in runs[i + 1:] if x["mode"] == "baseline"), before)
            overheads.append(100 * (r["loop_s"] / ((before + after) / 2) - 1))
        rows.append({
            "mode": name, "saves": len(blocked), "blocked_p50_ms": h.median(blocked),
            "blocked_p90_ms": h.percentile(blocked, 90), "first_save_ms": mine[0][1]["blocked_ms"][0],
            "loop_s": ", ".join(f"{r['loop_s']:.1f}" for _, r in mine),
            "overhead_pct": ", ".join(f"{o:+.0f}" for o in overheads),
            "final_wait_s": h.median([r["final_wait_s"] for _, r in mine]),
            "load_s": h.median([r["load_s"] for _, r in mine]),
            "machine_busy_pct": h.median([r["machine_busy_pct"] for _, r in mine]),
        })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--workers", type=int, default=1, help="mpckpt uploaders per rank")
    parser.add_argument("--json", default=os.path.join(h.RESULTS_DIR, "dcp_front_door.json"))
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if set(modes) - set(MODES):
        sys.exit(f"unknown modes {sorted(set(modes) - set(MODES))}; choose from {MODES}")
    group = dist.new_group(backend="gloo")  # DCP's background thread talks on a group of its own
    loop = Loop(args.layers, args.hidden, args.batch, rank, world)
    state_bytes = sum(dist_all_gather(loop.state_bytes()))
    root = dist_broadcast(tempfile.mkdtemp(prefix="mpckpt-dcp-door-") if rank == 0 else None)
    if rank == 0:
        print("command: torchrun --nproc-per-node", world, " ".join(sys.argv), flush=True)
        print(f"{world} ranks, {args.layers} x Linear({args.hidden}): {state_bytes / h.MIB:.0f} MiB of state, "
              f"{args.steps} steps, a save every {args.every}", flush=True)
    order = ["baseline"]
    for _ in range(args.rounds):
        order += [*modes, "baseline"]
    runs = []
    try:
        for i, name in enumerate(order):
            merged = merge(dist_all_gather(run(name, loop, os.path.join(root, f"{i:02d}-{name}"), args, group)))
            runs.append(merged)
            if rank == 0:
                print(f"{name}: loop {merged['loop_s']:.1f} s, blocked ms {merged['blocked_ms']}, final wait "
                      f"{merged['final_wait_s']:.2f} s, load {merged['load_s']} s, machine busy "
                      f"{merged['machine_busy_pct']:.0f}%", flush=True)
                shutil.rmtree(os.path.join(root, f"{i:02d}-{name}"), ignore_errors=True)
            dist.barrier()
    finally:
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
    if rank == 0:
        rows = summarize(runs)
        print()
        print(h.markdown_table(rows, COLUMNS))
        h.write_json(args.json, {"machine": h.machine_info(), "args": vars(args), "world_size": world,
                                 "state_bytes": state_bytes, "rows": rows, "runs": runs})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
