"""Compare checkpointing strategies on one training loop: blocked time, slowdown, memory, bytes.

One run, the same model (``nn.Linear`` stack + Adam, ``--gib`` GiB of state), the same
loop of ``--steps`` training steps with a checkpoint every ``--every`` steps, the same
target folder, in turn for each mode:

  baseline        no checkpoint (run first and again last; the loop time is their mean)
  floor           bare ``copy_`` of every tensor into preallocated, pre-touched shared memory
  torch_save      ``torch.save`` of model + optimizer state dicts, synchronous
  dcp_thread      ``torch.distributed.checkpoint.async_save``, thread executor, cached
                  shared-memory ``DefaultStager``; one checkpoint in flight (the recipe)
  dcp_process     the same with the process executor
  lightning       ``AsyncCheckpointIO(TorchCheckpointIO())`` (when lightning is installed)
  mpckpt_eager    ``Checkpointer(dir, workers=2)``, ``prepare(state)`` before the loop, ASYNC saves
  mpckpt_cold     the same without ``prepare``: a fresh run that never restores (first save pays
                  for making the shared memory)
  mpckpt_trigger  the same as cold, but with ``trigger=EveryNSteps(every)`` and ``save()`` called
                  every step (the not-due calls make the first slab in the background)
  mpckpt_overlap  the same with ``overlap=True`` (marked unavailable if the option is missing)

Each mode runs in a fresh subprocess (``--child``); the parent samples its memory and
collects one JSON line. Blocked time is the wall time of the save call as the loop sees it
(for DCP: waiting for the previous checkpoint, ``get_state_dict`` and ``async_save``);
wait at exit is the final wait for every upload; loop time is the loop without that wait.

    .venv/bin/python bench/compare.py --gib 1 --steps 30 --every 5
    .venv/bin/python bench/compare.py --hidden 512 --modes baseline,floor,dcp_thread,mpckpt_eager,mpckpt_cold,mpckpt_overlap
    .venv/bin/python bench/compare.py --rounds 3 --modes baseline,dcp_thread,mpckpt_eager   # loop overhead

With ``--rounds N`` every mode runs N times, each run between two baselines; its loop overhead is
measured against the mean of those two, and the table gives medians over the rounds (blocked
figures over all saves of all rounds) and the baselines' spread, so this machine's drift shows.
"""

from __future__ import annotations

import argparse
import inspect
import os
import shutil
import socket
import sys
import time
from typing import Any

import _harness as h

MODES = ["baseline", "floor", "torch_save", "dcp_thread", "dcp_process", "lightning",
         "mpckpt_eager", "mpckpt_cold", "mpckpt_trigger", "mpckpt_overlap"]
COLUMNS = [
    ("mode", "mode", 0), ("blocked_median_ms", "blocked median ms", 1), ("blocked_p90_ms", "blocked p90 ms", 1),
    ("blocked_max_ms", "blocked max ms", 1),
    ("first_save_ms", "first save ms", 1), ("wait_at_exit_s", "wait at exit s", 2), ("loop_s", "loop s", 2),
    ("overhead_pct", "overhead %", 1), ("peak_mib", "peak MiB", 0), ("written_mib", "written MiB", 0),
    ("foreign_cpu_pct", "other procs CPU %", 0),
]


NOISY_PCT = 10.0  # a run during which other processes used more of the CPUs than this is retried


class Unavailable(Exception):
    """This mode cannot run here (a package or an option is missing)."""


# -- modes: open before the loop, save (timed: blocked), finish (timed: wait at exit), close --------
class Mode:
    calls_every_step = False  # save() is called every step; the mode decides which are due

    def open(self, work: h.Workload, folder: str, args: argparse.Namespace) -> None:
        self.work, self.folder = work, folder

    def save(self, step: int, loss: float) -> None:
        pass

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass

    def extra(self) -> dict[str, Any]:
        return {}


class Floor(Mode):
    def open(self, work: h.Workload, folder: str, args: argparse.Namespace) -> None:
        super().open(work, folder, args)
        self.floor = h.ShmFloor(h.state_tensors(work))

    def save(self, step: int, loss: float) -> None:
        self.floor.copy()


class TorchSave(Mode):
    def save(self, step: int, loss: float) -> None:
        import torch

        state = {"model": self.work.model.state_dict(), "optim": self.work.optimizer.state_dict(), "step": step}
        torch.save(state, os.path.join(self.folder, f"step-{step}.pt"))


class Dcp(Mode):
    """DCP ``async_save`` as its recipe shows: a gloo group, a reused stager, one save in flight.

    The stager is ``DefaultStager`` with shared memory, which caches its staging storages
    between saves. Pinned memory, async staging and non-blocking copies need an accelerator
    (DefaultStager refuses non-blocking copies without one), so on a CPU machine they are off
    and staging happens inside ``async_save``.
    """

    def __init__(self, executor: str) -> None:
        self.executor = executor
        self.future: Any = None
        self.waited_ms: list[float] = []

    def open(self, work: h.Workload, folder: str, args: argparse.Namespace) -> None:
        super().open(work, folder, args)
        import torch
        import torch.distributed as dist
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
        accel = torch.cuda.is_available()
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=accel, use_shared_memory=True,
                                                   use_async_staging=accel, use_non_blocking_copy=accel))
        self.kind = AsyncCheckpointerType.PROCESS if self.executor == "process" else AsyncCheckpointerType.THREAD

    def save(self, step: int, loss: float) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if self.future is not None:  # the recipe: never queue a second checkpoint
            started = time.perf_counter()
            _upload_future(self.future).result()
            self.waited_ms.append((time.perf_counter() - started) * 1e3)
        model_sd, optim_sd = get_state_dict(self.work.model, self.work.optimizer)
        self.future = dcp.async_save({"model": model_sd, "optim": optim_sd},
                                     checkpoint_id=os.path.join(self.folder, f"step-{step}"),
                                     async_checkpointer_type=self.kind, async_stager=self.stager)
        if hasattr(self.future, "staging_completion"):  # async staging: must finish before optimizer.step
            self.future.staging_completion.result()

    def finish(self) -> None:
        if self.future is not None:
            _upload_future(self.future).result()

    def close(self) -> None:
        import torch.distributed as dist

        self.stager.close()
        dist.destroy_process_group()

    def extra(self) -> dict[str, Any]:
        return {"waited_for_previous_ms": [round(x, 1) for x in self.waited_ms]}


def _upload_future(response: Any) -> Any:
    return getattr(response, "upload_completion", response)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Lightning(Mode):
    def open(self, work: h.Workload, folder: str, args: argparse.Namespace) -> None:
        super().open(work, folder, args)
        try:
            from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
        except ImportError as e:
            raise Unavailable(f"lightning is not installed ({e})") from e
        self.io = AsyncCheckpointIO(TorchCheckpointIO())

    def save(self, step: int, loss: float) -> None:
        checkpoint = {"state_dict": self.work.model.state_dict(), "optimizer_states": [self.work.optimizer.state_dict()],
                      "global_step": step, "epoch": 0}
        self.io.save_checkpoint(checkpoint, os.path.join(self.folder, f"step={step}.ckpt"))

    def finish(self) -> None:
        self.io.teardown()


class Mpckpt(Mode):
    def __init__(self, overlap: bool, *, prepare: bool = True, trigger: bool = False) -> None:
        self.overlap, self.prepare, self.calls_every_step = overlap, prepare, trigger

    def open(self, work: h.Workload, folder: str, args: argparse.Namespace) -> None:
        super().open(work, folder, args)
        import mpckpt

        kwargs: dict[str, Any] = {"workers": args.workers}
        if self.overlap:
            if "overlap" not in inspect.signature(mpckpt.Checkpointer).parameters:
                raise Unavailable("mpckpt.Checkpointer has no overlap option yet")
            kwargs["overlap"] = True
        if self.calls_every_step:
            kwargs["trigger"] = mpckpt.EveryNSteps(args.every)
        self.ckpt = mpckpt.Checkpointer(folder, **kwargs)
        if self.prepare:  # restore() does this too; mpckpt_cold is a fresh run that never calls either
            self.ckpt.prepare(work.state)

    def save(self, step: int, loss: float) -> None:
        self.ckpt.save(step, self.work.state, metrics={"loss": loss})

    def finish(self) -> None:
        self.ckpt.wait()

    def close(self) -> None:
        self.ckpt.close()

    def extra(self) -> dict[str, Any]:
        stats = self.ckpt.stats.as_dict()
        barrier = [s.get("barrier_ms", 0.0) for s in stats["saves"]]  # overlapped: optimizer.step() waited
        return {"overlap_config": bool(getattr(self.ckpt.config, "overlap", False)), "mpckpt_stats": stats,
                "barrier_median_ms": h.median(barrier), "barrier_max_ms": max(barrier, default=0.0)}


def make_mode(name: str) -> Mode:
    return {
        "baseline": Mode, "floor": Floor, "torch_save": TorchSave,
        "dcp_thread": lambda: Dcp("thread"), "dcp_process": lambda: Dcp("process"), "lightning": Lightning,
        "mpckpt_eager": lambda: Mpckpt(False), "mpckpt_cold": lambda: Mpckpt(False, prepare=False),
        "mpckpt_trigger": lambda: Mpckpt(False, prepare=False, trigger=True),
        "mpckpt_overlap": lambda: Mpckpt(True),
    }[name]()


# -- child: one mode, one loop --------------------------------------------------------------------
def run_mode(args: argparse.Namespace) -> dict[str, Any]:
    name = "baseline" if args.child.startswith("baseline") else args.child
    mode = make_mode(name)
    work = h.build_workload(args.gib, hidden=args.hidden)
    os.makedirs(args.dir, exist_ok=True)
    try:
        mode.open(work, args.dir, args)
    except Unavailable as e:
        return {"mode": args.child, "status": "unavailable", "reason": str(e)}
    checkpoint = name != "baseline"
    blocked: list[float] = []
    not_due: list[float] = []  # save() calls a trigger turned down (mpckpt_trigger only)
    step_s: list[float] = []
    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        loss = h.train_step(work)
        step_s.append(time.perf_counter() - t0)
        if checkpoint and step % args.every == 0:
            t0 = time.perf_counter()
            mode.save(step, loss)
            blocked.append((time.perf_counter() - t0) * 1e3)
        elif checkpoint and mode.calls_every_step:
            t0 = time.perf_counter()
            mode.save(step, loss)
            not_due.append((time.perf_counter() - t0) * 1e3)
    loop_s = time.perf_counter() - started
    t0 = time.perf_counter()
    mode.finish()
    wait_s = time.perf_counter() - t0
    mode.close()
    return {
        "mode": args.child, "status": "ok", "saves": len(blocked), "blocked_ms": [round(b, 2) for b in blocked],
        "blocked_median_ms": h.median(blocked) if blocked else None,
        "blocked_p90_ms": h.percentile(blocked, 90) if blocked else None,
        "blocked_max_ms": max(blocked) if blocked else None, "first_save_ms": blocked[0] if blocked else None,
        "wait_at_exit_s": wait_s if checkpoint else None, "loop_s": loop_s,
        "state_bytes": h.state_bytes(h.state_tensors(work)), "layers": work.layers,
        "written_mib": h.folder_bytes(args.dir) / h.MIB if checkpoint else None,
        "not_due_median_ms": h.median(not_due) if not_due else None,
        "step_median_s": h.median(step_s), "step_s": [round(x, 3) for x in step_s], **mode.extra(),
    }


# -- parent: every mode in turn, then table, JSON, chart ------------------------------------------
def run_all(args: argparse.Namespace) -> dict[str, Any]:
    folder, remove = h.target_dir(args.dir, "compare-")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(modes) - set(MODES)
    if unknown:
        sys.exit(f"unknown modes {sorted(unknown)}; choose from {MODES}")
    order = [m for m in MODES if m in modes]
    if args.rounds > 1:
        return run_rounds([m for m in order if m != "baseline"], folder, remove, args)
    if "baseline" in order:
        order.append("baseline_end")
    results: dict[str, dict[str, Any]] = {}
    try:
        for mode in order:
            results[mode] = run_one(mode, folder, args)
    finally:
        if remove:
            shutil.rmtree(folder, ignore_errors=True)
    return summarize(results, args)


def run_one(mode: str, folder: str, args: argparse.Namespace) -> dict[str, Any]:
    mode_dir = os.path.join(folder, mode)
    print(f"[compare] {mode} ...", file=sys.stderr, flush=True)
    argv = [os.path.abspath(__file__), "--child", mode, "--gib", str(args.gib), "--steps", str(args.steps),
            "--every", str(args.every), "--workers", str(args.workers), "--dir", mode_dir, "--hidden", str(args.hidden)]
    return run_quietest(argv, mode, mode_dir, args)


def run_rounds(modes: list[str], folder: str, remove: bool, args: argparse.Namespace) -> dict[str, Any]:
    """``--rounds`` times: a baseline before and after every mode, so each mode's loop overhead is
    measured against the baselines run right beside it, and their spread shows this machine's drift."""
    baselines: list[float] = []
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    try:
        for _ in range(args.rounds):
            for mode in modes:
                if not baselines:
                    baselines.append(run_one("baseline", folder, args)["loop_s"])
                run = run_one(mode, folder, args)
                baselines.append(run_one("baseline", folder, args)["loop_s"])
                if run.get("status") == "ok":
                    beside = (baselines[-2] + baselines[-1]) / 2
                    run["baseline_beside_s"] = beside
                    run["overhead_pct"] = (run["loop_s"] - beside) / beside * 100
                runs[mode].append(run)
    finally:
        if remove:
            shutil.rmtree(folder, ignore_errors=True)
    rows = [{"mode": "baseline", "status": "ok", "loop_s": h.median(baselines), "overhead_pct": 0.0,
             "runs": len(baselines)}]
    for mode, mode_runs in runs.items():
        ok = [r for r in mode_runs if r.get("status") == "ok"]
        if not ok:
            rows.append(mode_runs[0] if mode_runs else {"mode": mode, "status": "missing"})
            continue
        blocked = [b for r in ok for b in r["blocked_ms"]]
        rows.append({**ok[0], "runs": len(ok), "blocked_ms": blocked,
                     "blocked_median_ms": h.median(blocked) if blocked else None,
                     "blocked_p90_ms": h.percentile(blocked, 90) if blocked else None,
                     "blocked_max_ms": max(blocked) if blocked else None,
                     "first_save_ms": h.median([r["first_save_ms"] for r in ok]) if blocked else None,
                     "first_saves_ms": [r["first_save_ms"] for r in ok],
                     "loop_s": h.median([r["loop_s"] for r in ok]),
                     "overhead_pct": h.median([r["overhead_pct"] for r in ok]),
                     "overheads_pct": [round(r["overhead_pct"], 1) for r in ok],
                     "foreign_cpu_pct": max(r.get("foreign_cpu_pct", 0) for r in ok)})
    spread = (max(baselines) - min(baselines)) / h.median(baselines) * 100 if baselines else None
    return {"benchmark": "compare", "args": vars(args), "machine": h.machine_info(),
            "baseline_loop_s": {"median": h.median(baselines), "runs": baselines, "spread_pct": spread},
            "modes": rows, "raw": {m: r for m, r in runs.items()}}


def run_quietest(argv: list[str], mode: str, mode_dir: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run one mode; while other processes took over ``NOISY_PCT`` of the CPUs, run it again (``--retries``).

    Keeps the run that other processes disturbed least; ``attempts`` says how many there were.
    """
    best: dict[str, Any] | None = None
    for attempt in range(1, args.retries + 2):
        busy = h.wait_for_quiet(args.wait_quiet_s)
        run = {"mode": mode, "busy_before_pct": busy, "attempts": attempt, **h.run_child(argv, sample_ms=args.sample_ms)}
        shutil.rmtree(mode_dir, ignore_errors=True)
        if best is None or run.get("foreign_cpu_pct", 100) < best.get("foreign_cpu_pct", 100):
            best = {**run, "attempts": attempt}
        if run.get("status") != "ok" or run.get("foreign_cpu_pct", 0) <= NOISY_PCT:
            break
        print(f"[compare] {mode}: other processes used {run['foreign_cpu_pct']:.0f}% of the CPUs; again",
              file=sys.stderr, flush=True)
    assert best is not None
    return best


def summarize(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    starts = [results[m]["loop_s"] for m in ("baseline", "baseline_end") if results.get(m, {}).get("status") == "ok"]
    base = sum(starts) / len(starts) if starts else None
    rows = []
    for mode, r in results.items():
        if mode == "baseline_end":
            continue
        row = dict(r)
        if mode == "baseline" and base is not None:
            row["loop_s"] = base
        if r.get("status") == "ok" and base:
            row["overhead_pct"] = (row["loop_s"] - base) / base * 100
        rows.append(row)
    return {"benchmark": "compare", "args": vars(args), "machine": h.machine_info(),
            "baseline_loop_s": {"mean": base, "runs": starts}, "modes": rows, "raw": results}


def print_table(summary: dict[str, Any]) -> None:
    ok = [r for r in summary["modes"] if r.get("status") == "ok"]
    print(h.markdown_table(ok, COLUMNS))
    for r in summary["modes"]:
        if r.get("status") != "ok":
            print(f"\n{r['mode']}: {r.get('status')} - {r.get('reason') or r.get('error')}")
    noisy = [f"{r['mode']} {r['foreign_cpu_pct']:.0f}%" for r in ok if r.get("foreign_cpu_pct", 0) > 10]
    base = summary["baseline_loop_s"]
    if "spread_pct" in base:
        print(f"\nbaseline loop: {len(base['runs'])} runs, median {base['median']:.2f} s, spread "
              f"{base['spread_pct']:.1f}% ({min(base['runs']):.2f}-{max(base['runs']):.2f} s); overhead per run: "
              + "; ".join(f"{r['mode']} {r['overheads_pct']}" for r in ok if "overheads_pct" in r))
    if noisy:
        print(f"\nwarning: other processes used the CPUs during: {', '.join(noisy)}")


def draw_chart(summary: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in summary["modes"] if r.get("status") == "ok" and r["mode"] != "baseline"]
    noisy = [r.get("foreign_cpu_pct", 0) > NOISY_PCT for r in rows]
    names = [r["mode"] + (" *" if n else "") for r, n in zip(rows, noisy, strict=True)]
    colors = ["#d62728" if n.startswith("mpckpt") else "#7f7f7f" if n == "floor" else "#1f77b4" for n in names]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    blocked = [max(r["blocked_median_ms"], 1e-3) for r in rows]
    left.barh(names, blocked, color=colors)
    left.set_xscale("log")
    left.set_xlabel("median blocked time per save, ms (log)")
    for i, v in enumerate(blocked):
        left.text(v, i, f" {v:,.0f}" if v >= 10 else f" {v:.2g}", va="center", fontsize=8)
    over = [r.get("overhead_pct", 0.0) for r in rows]
    right.barh(names, over, color=colors)
    right.axvline(0, color="black", linewidth=0.8)
    right.set_xlabel("training loop time over the baseline, %")
    for i, v in enumerate(over):
        right.text(v, i, f" {v:+.0f}%", va="center", fontsize=8)
    for ax in (left, right):
        ax.invert_yaxis()
    args = summary["args"]
    fig.suptitle(f"{args['gib']} GiB state, {args['steps']} steps, a save every {args['every']} "
                 f"({summary['machine']['cpus']} CPUs)")
    if any(noisy):
        fig.text(0.01, 0.01, f"* other processes used more than {NOISY_PCT:.0f}% of the CPUs during this run",
                 fontsize=8, color="#555555")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="checkpoint state size: params + 2 Adam moments (GiB)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=5, help="a checkpoint every this many steps")
    p.add_argument("--hidden", type=int, default=2048,
                   help="width of the Linear layers: 512 makes 1 GiB a state of ~340 layers and ~2,700 tensors")
    p.add_argument("--modes", default=",".join(MODES), help="comma list; default all")
    p.add_argument("--workers", type=int, default=2, help="mpckpt uploader processes")
    p.add_argument("--out", default=os.path.join(h.RESULTS_DIR, "compare.json"))
    p.add_argument("--chart", default=os.path.join(h.REPO_DIR, "docs", "bench_compare.png"))
    p.add_argument("--dir", default=None, help="target folder (default: a temporary one under bench/results/)")
    p.add_argument("--sample-ms", type=float, default=250,
                   help="memory sampling period (each sample reads the child's smaps: every 20 ms that slowed a "
                        "1 GiB copy by a third on 2 cores)")
    p.add_argument("--wait-quiet-s", type=float, default=120,
                   help="before each mode, wait up to this long for other processes to leave the CPUs idle")
    p.add_argument("--rounds", type=int, default=1,
                   help="more than 1: every mode this many times, each between two baselines; medians reported")
    p.add_argument("--retries", type=int, default=2,
                   help=f"run a mode again (at most this often) when other processes used >{NOISY_PCT:.0f}%% of the CPUs")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.child:
        h.emit_result(run_mode(args))
        return
    summary = run_all(args)
    h.write_json(args.out, summary)
    print_table(summary)
    if args.chart:
        draw_chart(summary, args.chart)
    print(f"\nresults: {args.out}\nchart: {args.chart}")


if __name__ == "__main__":
    main()
