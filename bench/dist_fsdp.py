"""FSDP2 training under torchrun: mpckpt against torch.distributed.checkpoint's async_save, same loop.

Every rank builds the same model, a stack of ``--layers`` ``nn.Linear(--hidden, --hidden)``
with ReLU, each layer and the root ``fully_shard``-ed on ``init_device_mesh("cpu", (world,))``
(gloo), with AdamW; one warm-up step creates AdamW's moments, so the checkpoint state is
params + two moments (8 layers of 2048: 403 MB in all, half per rank at nproc 2). A step is
forward, MSE loss, backward, ``optimizer.step()``, ``zero_grad`` on a fixed per-rank batch.
Then, in the same processes and on the same model, the loop of ``--steps`` steps runs in turn
in each mode, saving after every ``--every`` steps:

  baseline  no checkpoint; runs before the first mode and again after each round, so every
            checkpointing run sits between two baselines (its overhead is against their mean)
  mpckpt    ``mpckpt.Checkpointer(folder, workers=--workers)``, ``restore(state)`` on the empty
            folder first (what a resumable run does; it makes the shared memory), then
            ``ckpt.save(step, {"model": model, "optim": opt})`` (ASYNC: returns after the snapshot)
  mpckpt_overlap  the same with ``overlap=True``: ``save`` returns at once, the copy overlaps the
            next forward/backward, and an optimizer-step pre-hook waits for it (that wait is in
            the loop time, not in the blocked time)
  dcp       ``torch.distributed.checkpoint.async_save`` the way its async recipe runs it: the
            previous checkpoint awaited before the next save (DCP allows one in flight),
            ``get_state_dict(model, opt)``, ``async_checkpointer_type=AsyncCheckpointerType.PROCESS``
            and one cached ``DefaultStager(StagingOptions(use_pinned_memory=False,
            use_shared_memory=True, use_async_staging=False, use_non_blocking_copy=False))``
            per run (pinned memory and non-blocking copies need an accelerator; async staging
            on CPU would copy in a thread beside training, which is mode ``dcp_async``)
  dcp_async the same with ``use_async_staging=True``: the copy runs in DCP's staging thread and
            the loop waits for ``staging_completion`` before the next ``optimizer.step()``
            (that wait is in the loop time, reported apart, not in the blocked time)

Figures per mode (blocked times: the slower rank of each save; loop time: the slower rank):

- blocked time per save, measured around the save call on the training thread (for DCP: the
  wait for the previous checkpoint, ``get_state_dict`` and ``async_save``), p50 and p90 over
  all saves of all rounds, and the first save of the first round apart (DCP starts its
  checkpoint process then, and each run's fresh stager allocates its staging memory in its
  first save; mpckpt started its uploaders at open and made its slab in ``restore``);
- loop time (the ``--steps`` steps, saves included, the final wait not) and its overhead against
  the mean of the two baselines around it, per round;
- bytes written per checkpoint (the files of one checkpoint folder, apparent size);
- for the overlapped modes, what ``optimizer.step()`` waited for the copy (rank 0: mpckpt's
  ``barrier_ms``, DCP's ``staging_completion``), which is in the loop time;
- the time until the last checkpoint is durable, from the end of the loop (``ckpt.wait()``;
  DCP: the last future's ``result()``), and from the start of the last save call.

Every checkpoint goes to a fresh folder under ``--dir`` (default: a temporary folder in /tmp,
removed at the end). Rank 0 prints the table and writes the JSON.

    .venv/bin/torchrun --standalone --nproc-per-node 2 bench/dist_fsdp.py --layers 8 --steps 20 --every 5 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from typing import Any

import _harness as h
import psutil
import torch
import torch.distributed as dist
from torch import nn

MODES = ("mpckpt", "mpckpt_overlap", "dcp", "dcp_async")
COLUMNS = [
    ("mode", "mode", 0), ("saves", "saves", 0), ("blocked_p50_ms", "blocked p50 ms", 1),
    ("blocked_p90_ms", "blocked p90 ms", 1), ("first_save_ms", "first save ms", 1),
    ("step_wait_p50_ms", "optimizer.step() waited p50 ms (rank 0)", 1),
    ("loop_s", "loop s (per round)", 0), ("overhead_pct", "overhead % (per round)", 0),
    ("written_mib", "MiB per checkpoint", 1), ("final_wait_s", "loop end -> durable s", 2),
    ("last_save_to_durable_s", "last save -> durable s", 2), ("machine_busy_pct", "machine CPU busy %", 0),
]


class Loop:
    """The model, its optimizer and a fixed batch; one training step."""

    def __init__(self, layers: int, hidden: int, batch: int, rank: int, world: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        mesh = init_device_mesh("cpu", (world,))
        stack: list[nn.Module] = []
        for _ in range(layers):
            stack += [nn.Linear(hidden, hidden), nn.ReLU()]
        self.model = nn.Sequential(*stack)
        for layer in self.model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        gen = torch.Generator().manual_seed(1000 + rank)
        self.inputs = torch.randn(batch, hidden, generator=gen)
        self.targets = torch.randn(batch, hidden, generator=gen)
        self.before_step: Any = None  # called before optimizer.step() (dcp_async's staging wait)
        self.step()  # AdamW's moments exist from here on

    def step(self) -> None:
        loss = nn.functional.mse_loss(self.model(self.inputs), self.targets)
        loss.backward()
        if self.before_step is not None:
            self.before_step()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def state_bytes(self) -> int:
        """Bytes of this rank's shards of params and optimizer state."""
        total = sum(p.to_local().nbytes for p in self.model.parameters())
        for st in self.opt.state.values():
            total += sum(v.to_local().nbytes if hasattr(v, "to_local") else v.nbytes
                         for v in st.values() if isinstance(v, torch.Tensor))
        return total


class Mode:
    """No checkpoint; subclasses time their save inside the loop."""

    def __init__(self, loop: Loop, folder: str, args: argparse.Namespace) -> None:
        self.loop, self.folder, self.args = loop, folder, args
        self.extra: dict[str, Any] = {}

    def save(self, step: int) -> None:
        pass

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass

    def checkpoint_folders(self) -> list[str]:
        return []


class Mpckpt(Mode):
    def __init__(self, loop: Loop, folder: str, args: argparse.Namespace, *, overlap: bool = False) -> None:
        super().__init__(loop, folder, args)
        import mpckpt

        self.state = {"model": loop.model, "optim": loop.opt}
        self.ckpt = mpckpt.Checkpointer(folder, workers=args.workers, overlap=overlap)
        self.ckpt.restore(self.state)  # an empty root: nothing to load, the shared memory is made
        self.blocked_ms: list[float] = []

    def save(self, step: int) -> None:
        future = self.ckpt.save(step, self.state)
        stats = getattr(future, "stats", None)
        if stats is not None:
            self.blocked_ms.append(float(stats.blocked_ms))

    def finish(self) -> None:
        self.ckpt.wait()

    def close(self) -> None:
        self.ckpt.close()
        self.extra["mpckpt_blocked_ms"] = [round(x, 1) for x in self.blocked_ms]
        saves = self.ckpt.stats.as_dict().get("saves", [])  # overlapped: what optimizer.step() waited
        self.extra["step_wait_ms"] = [round(float(s.get("barrier_ms") or 0.0), 1) for s in saves]

    def checkpoint_folders(self) -> list[str]:
        return sorted(os.path.join(self.folder, n) for n in os.listdir(self.folder) if n.startswith("step_"))


class Dcp(Mode):
    def __init__(self, loop: Loop, folder: str, args: argparse.Namespace, *, async_staging: bool) -> None:
        super().__init__(loop, folder, args)
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=True,
                                                   use_async_staging=async_staging, use_non_blocking_copy=False))
        self.future: Any = None
        self.staging: Any = None
        self.waited_ms: list[float] = []
        if async_staging:
            loop.before_step = self._staged

    def _staged(self) -> None:
        """Before optimizer.step(): the staging thread must have copied the parameters."""
        if self.staging is not None:
            t0 = time.perf_counter()
            self.staging.result()
            self.staging = None
            self.waited_ms.append((time.perf_counter() - t0) * 1e3)

    def save(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        if self.future is not None:  # one checkpoint in flight at most
            getattr(self.future, "upload_completion", self.future).result()
        model_sd, optim_sd = get_state_dict(self.loop.model, self.loop.opt)
        self.future = dcp.async_save({"model": model_sd, "optim": optim_sd},
                                     checkpoint_id=os.path.join(self.folder, f"step-{step}"),
                                     async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                                     async_stager=self.stager)
        self.staging = getattr(self.future, "staging_completion", None)

    def finish(self) -> None:
        self._staged()
        if self.future is not None:
            getattr(self.future, "upload_completion", self.future).result()

    def close(self) -> None:
        self.stager.close()
        self.loop.before_step = None
        self.extra["step_wait_ms"] = [round(x, 1) for x in self.waited_ms]

    def checkpoint_folders(self) -> list[str]:
        return sorted(os.path.join(self.folder, n) for n in os.listdir(self.folder) if n.startswith("step-"))


def make_mode(name: str, loop: Loop, folder: str, args: argparse.Namespace) -> Mode:
    if name in ("mpckpt", "mpckpt_overlap"):
        return Mpckpt(loop, folder, args, overlap=name == "mpckpt_overlap")
    if name in ("dcp", "dcp_async"):
        return Dcp(loop, folder, args, async_staging=name == "dcp_async")
    return Mode(loop, folder, args)


def run_mode(name: str, loop: Loop, folder: str, args: argparse.Namespace) -> dict[str, Any]:
    """One loop in mode ``name`` on this rank: its timings (gathered and merged by the caller)."""
    if dist.get_rank() == 0:
        os.makedirs(folder, exist_ok=True)
    dist.barrier()
    mode = make_mode(name, loop, folder, args)
    dist.barrier()
    psutil.cpu_percent(None)
    blocked: list[float] = []
    last_save_at = 0.0
    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        loop.step()
        if name != "baseline" and step % args.every == 0:
            last_save_at = time.perf_counter()
            mode.save(step)
            blocked.append((time.perf_counter() - last_save_at) * 1e3)
    loop_end = time.perf_counter()
    mode.finish()
    durable = time.perf_counter()
    busy = psutil.cpu_percent(None)
    mode.close()
    dist.barrier()
    written = [h.folder_bytes(f) for f in mode.checkpoint_folders()] if dist.get_rank() == 0 else []
    return {"mode": name, "blocked_ms": blocked, "loop_s": loop_end - started, "final_wait_s": durable - loop_end,
            "last_save_to_durable_s": durable - last_save_at if blocked else None,
            "written_bytes": written, "machine_busy_pct": busy, **mode.extra}


def merge(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode run over the ranks: each save as slow as its slowest rank, and the slowest loop."""
    out = dict(per_rank[0])
    out["blocked_ms"] = [round(max(x), 2) for x in zip(*(r["blocked_ms"] for r in per_rank), strict=True)]
    for key in ("loop_s", "final_wait_s", "last_save_to_durable_s"):
        values = [r[key] for r in per_rank if r[key] is not None]
        out[key] = max(values) if values else None
    out["blocked_ms_per_rank"] = [[round(x, 1) for x in r["blocked_ms"]] for r in per_rank]
    return out


def summarize(runs: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    baselines = [r["loop_s"] for r in runs if r["mode"] == "baseline"]
    rows = []
    for name in MODES:
        mine = [(i, r) for i, r in enumerate(runs) if r["mode"] == name]
        if not mine:
            continue
        blocked = [b for _, r in mine for b in r["blocked_ms"]]
        overheads = []
        for i, r in mine:  # against the mean of the nearest baseline before and after
            before = next(x["loop_s"] for x in reversed(runs[:i]) if x["mode"] == "baseline")
            after = next((x["loop_s"] for x in runs[i + 1:] if x["mode"] == "baseline"), before)
            overheads.append(100 * (r["loop_s"] / ((before + after) / 2) - 1))
        written = [w for _, r in mine for w in r["written_bytes"]]
        rows.append({
            "mode": name, "saves": len(blocked), "blocked_p50_ms": h.median(blocked),
            "blocked_p90_ms": h.percentile(blocked, 90), "first_save_ms": mine[0][1]["blocked_ms"][0],
            "loop_s": ", ".join(f"{r['loop_s']:.1f}" for _, r in mine),
            "overhead_pct": ", ".join(f"{o:+.0f}" for o in overheads),
            "overhead_median_pct": h.median(overheads),
            "written_mib": statistics.mean(written) / h.MIB if written else None,
            "final_wait_s": h.median([r["final_wait_s"] for _, r in mine]),
            "last_save_to_durable_s": h.median([r["last_save_to_durable_s"] for _, r in mine]),
            "machine_busy_pct": h.median([r["machine_busy_pct"] for _, r in mine]),
            "step_wait_p50_ms": h.median([w for _, r in mine for w in r.get("step_wait_ms", [])])
            if name in ("mpckpt_overlap", "dcp_async") else None,
        })
    base = {"mode": "baseline", "saves": 0, "loop_s": ", ".join(f"{b:.1f}" for b in baselines),
            "machine_busy_pct": h.median([r["machine_busy_pct"] for r in runs if r["mode"] == "baseline"])}
    spread = {"baseline_min_s": min(baselines), "baseline_max_s": max(baselines),
              "baseline_spread_pct": 100 * (max(baselines) / min(baselines) - 1)}
    return [base, *rows], spread


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2, help="every mode this many times, baselines between")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--workers", type=int, default=1, help="mpckpt uploaders per rank")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: cores / ranks)")
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary folder in /tmp)")
    parser.add_argument("--json", default=os.path.join(h.RESULTS_DIR, "dist_fsdp.json"))
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // world))
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if set(modes) - set(MODES):
        sys.exit(f"unknown modes {sorted(set(modes) - set(MODES))}; choose from {MODES}")
    if rank == 0:
        print("command: torchrun --nproc-per-node", world, " ".join(sys.argv), flush=True)
    loop = Loop(args.layers, args.hidden, args.batch, rank, world)
    state_bytes = sum(dist_all_gather(loop.state_bytes()))
    root = dist_broadcast(args.dir or tempfile.mkdtemp(prefix="mpckpt-dist-fsdp-") if rank == 0 else None)
    if rank == 0:
        print(f"{world} ranks, {args.layers} x Linear({args.hidden}): {state_bytes / h.MIB:.0f} MiB of state "
              f"(params + AdamW moments), {args.steps} steps, a save every {args.every}", flush=True)
    order = ["baseline"]
    for _ in range(args.rounds):
        order += [*modes, "baseline"]
    runs = []
    try:
        for i, name in enumerate(order):
            result = run_mode(name, loop, os.path.join(root, f"{i:02d}-{name}"), args)
            merged = merge(dist_all_gather(result))
            runs.append(merged)
            if rank == 0:
                print(f"{name}: loop {merged['loop_s']:.1f} s, blocked ms {merged['blocked_ms']}, final wait "
                      f"{merged['final_wait_s']:.2f} s, machine busy {merged['machine_busy_pct']:.0f}%", flush=True)
                shutil.rmtree(os.path.join(root, f"{i:02d}-{name}"), ignore_errors=True)
            dist.barrier()
    finally:
        if rank == 0 and not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    if rank == 0:
        rows, spread = summarize(runs)
        print()
        print(h.markdown_table(rows, COLUMNS))
        print(f"\nbaseline loop {spread['baseline_min_s']:.1f} .. {spread['baseline_max_s']:.1f} s "
              f"(spread {spread['baseline_spread_pct']:.0f}%); state {state_bytes / h.MIB:.0f} MiB")
        h.write_json(args.json, {"machine": h.machine_info(), "args": vars(args), "world_size": world,
                                 "state_bytes": state_bytes, "rows": rows, "spread": spread, "runs": runs,
                                 "host": socket.gethostname()})
    dist.barrier()
    dist.destroy_process_group()


def dist_all_gather(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def dist_broadcast(obj: Any) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


if __name__ == "__main__":
    main()
