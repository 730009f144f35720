"""Kill to the next training step: healing in place (``python -m mpckpt.run``) against a torchrun relaunch.

A 2-rank DDP job (gloo, CPU; an MLP whose model and AdamW moments make ``--state-mb`` MB per rank,
9.8 by default) saves to memory every step; at step ``--kill-step``, and no sooner than
``--running-s`` after its group formed (a job that has run a while), rank 1 SIGKILLs itself between
its backward and its optimizer step. The same job runs under both launchers, ``--repeats`` times:

- ``mpckpt.run``: rank 0 keeps its process and heals in place (``mpckpt.heal``), a replacement of
  rank 1 starts; both restore from memory;
- ``torchrun --max-restarts 1``: torchrun stops rank 0 and starts both again; both restore from
  memory (the script is the same: outside mpckpt.run, ``heal`` raises the failure again).

Each process writes its events with wall-clock times; the figures are, per run, from the kill
(the killed rank's time just before its SIGKILL) to the end of the first training step after it
on every rank, and the parts of it:

- ``detect``: the kill to the survivor's ``heal`` call (its collective failed) / under mpckpt.run
  also the launcher's notice (``mpckpt-run/began/<g>``);
- ``replacement start``: the launcher's notice to the replacement's Python and torch imported;
- ``form``: the survivor's re-forming of the group (which waits for the replacement to join);
- ``heal``: the survivor's rebuild + open + restore; ``first step``: the restore to the step's end.

    .venv/bin/python bench/heal_in_job.py --repeats 3
    .venv/bin/python bench/heal_in_job.py --repeats 1 --json bench/results/heal_in_job.json
    .venv/bin/python bench/heal_in_job.py --repeats 3 --spares 0      # replacements started cold

Prints medians of both launchers side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO_DIR = HERE.parent


def rank_main() -> None:
    """One rank (under either launcher): train, save to memory, die once, heal or restart."""
    began = time.time()
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(REPO_DIR))
    import mpckpt
    from mpckpt import healing

    imported = time.time()
    cfg = json.loads(os.environ["HEAL_BENCH"])
    generation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.set_num_threads(1)
    mpckpt.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=60))
    rank = dist.get_rank()
    formed = time.time()
    events = Path(cfg["out"]) / f"events-{rank}-{os.getpid()}.jsonl"

    def note(event: str, **extra: Any) -> None:
        with open(events, "a") as f:
            f.write(json.dumps({"event": event, "t": time.time(), "generation": generation, **extra}) + "\n")

    note("started", at=began)
    note("imported", at=imported)
    note("formed", at=formed)
    width = cfg["width"]
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    holder = {"model": torch.nn.parallel.DistributedDataParallel(net)}

    def rewrap() -> None:
        holder["model"] = torch.nn.parallel.DistributedDataParallel(net)

    note("built")
    with mpckpt.Checkpointer(cfg["root"], workers=1, memory_budget="256MiB", timeout_s=60) as ckpt:
        state = {"model": net, "optim": opt}
        last = ckpt.restore(state)
        note("restored", step=last, source=None if ckpt.last_restore is None else ckpt.last_restore.source)
        step = 0 if last is None else last + 1
        first = True
        while step < cfg["steps"]:
            try:
                g = torch.Generator().manual_seed(1000 * step + rank)
                loss = holder["model"](torch.randn(16, width, generator=g)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                if rank == 1 and generation == 0 and step == cfg["kill_step"]:
                    time.sleep(max(0.0, formed + cfg["running_s"] - time.time()))  # a job that ran a while
                    note("kill", step=step)
                    os.kill(os.getpid(), 9)
                opt.step()
                ckpt.save(step, state, mode="memory")
                if first:
                    note("first_step", step=step)
                    first = False
                step += 1
            except Exception as error:
                note("failed", error=type(error).__name__)
                last = mpckpt.heal(ckpt, state, error, rebuild=rewrap)
                done = healing.history[-1]
                note("healed", step=last, phases=done.phases, began=done.started, noticed=done.noticed)
                step = 0 if last is None else last + 1
                first = True
    dist.destroy_process_group()


def one_run(launcher: str, args: argparse.Namespace, work: Path) -> dict[str, float]:
    out = work / launcher
    out.mkdir(parents=True)
    width = int(((args.state_mb * 1e6 / 4 / 3) / 2) ** 0.5)  # two square layers, weights + 2 AdamW moments
    cfg = {"root": str(work / f"root-{launcher}"), "out": str(out), "width": width, "steps": args.steps,
           "kill_step": args.kill_step, "running_s": args.running_s}
    env = {**os.environ, "HEAL_BENCH": json.dumps(cfg), "PYTHONPATH": str(REPO_DIR), "OMP_NUM_THREADS": "1"}
    module = "mpckpt.run" if launcher == "mpckpt.run" else "torch.distributed.run"
    spares = ["--spares", str(args.spares)] if launcher == "mpckpt.run" else []
    cmd = [sys.executable, "-m", module, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", *spares,
           str(Path(__file__).resolve()), "--rank-main"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"{launcher} exited with {done.returncode}:\n{done.stderr[-4000:]}")
    return figures(out, launcher)


def figures(out: Path, launcher: str) -> dict[str, float]:
    events: list[dict[str, Any]] = []
    for path in out.glob("events-*.jsonl"):
        rank, pid = path.stem.split("-")[1:]
        events += [{**json.loads(line), "rank": int(rank), "pid": int(pid)} for line in path.read_text().splitlines()]
    kill = next(e for e in events if e["event"] == "kill")
    after = [e for e in events if e["t"] > kill["t"]]
    firsts = [e["t"] for e in after if e["event"] == "first_step"]
    result = {"kill_to_next_step": max(firsts) - kill["t"]}
    if launcher == "mpckpt.run":
        healed = next(e for e in after if e["event"] == "healed")
        result["detect (survivor)"] = healed["began"] - kill["t"]
        result["detect (launcher)"] = healed["noticed"] - kill["t"]
        replacement = [e for e in after if e["generation"] >= 1]
        imported = next(e for e in replacement if e["event"] == "imported")
        started = next(e for e in replacement if e["event"] == "started")
        result["replacement start"] = imported["at"] - kill["t"]
        result["replacement python+torch"] = imported["at"] - started["at"]
        phases = healed["phases"]
        result["leave"] = phases.get("leave", 0.0)
        result["form"] = phases.get("form", 0.0)
        result["heal (rebuild+open+restore)"] = sum(phases.get(k, 0.0) for k in ("rebuild", "open", "restore"))
        result["first step"] = max(firsts) - max(e["t"] for e in after if e["event"] in ("healed", "restored"))
    else:
        restarted = [e for e in after if e["generation"] >= 1]
        result["detect+stop+start"] = min(e["at"] for e in restarted if e["event"] == "started") - kill["t"]
        result["python+torch"] = max(e["at"] - s["at"] for e in restarted if e["event"] == "imported"
                                     for s in restarted if s["event"] == "started" and s["pid"] == e["pid"])
        formed = max(e["t"] for e in restarted if e["event"] == "formed")
        restored = max(e["t"] for e in restarted if e["event"] == "restored")
        result["form+build+open+restore"] = restored - formed
        result["first step"] = max(firsts) - restored
    return result


def main() -> None:
    if "--rank-main" in sys.argv:
        return rank_main()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--state-mb", type=float, default=9.8)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--kill-step", type=int, default=20)
    p.add_argument("--spares", type=int, default=1, help="mpckpt.run's warm spares (0: a replacement starts cold)")
    p.add_argument("--running-s", type=float, default=10.0,
                   help="the kill comes no sooner than this after the group formed (a failure in a job that has run "
                        "a while: mpckpt.run's warm spare is ready)")
    p.add_argument("--timeout-s", type=float, default=300)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    runs: dict[str, list[dict[str, float]]] = {"mpckpt.run": [], "torchrun": []}
    for _ in range(args.repeats):
        for launcher in runs:
            work = Path(tempfile.mkdtemp(prefix="heal-bench-"))
            try:
                runs[launcher].append(one_run(launcher, args, work))
            finally:
                shutil.rmtree(work, ignore_errors=True)
    for launcher, results in runs.items():
        print(f"\n{launcher} ({len(results)} runs, medians, seconds)")
        for key in results[0]:
            print(f"  {key:32s} {statistics.median(r[key] for r in results):7.3f}")
    if args.json is not None:
        args.json.write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
