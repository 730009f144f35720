"""Steps a job loses when one rank is SIGKILLed, by the moment of the kill (issue 38).

Each job is ``tests/integration/job_kill_worker.py`` under ``torchrun --standalone --max-restarts 1``
(gloo, CPU), in the configuration of ``tests/integration/test_job_memory_kills.py``: a small model
under DDP with AdamW and a ``PerRank`` blob of 32 MiB per rank trains 10 deterministic steps, every
step saved with ``mode="memory"``, every 5th to storage (waited for, so storage's newest step is 5
when the kill comes), a memory budget of 160 MiB. On the first attempt one rank (1 of 2, 0 of 3)
SIGKILLs itself at step S = 7, at one moment:

``forward``       in the middle of S's forward;
``before_optim``  after S's backward, before its optimizer step, once every other rank saved S;
``in_save``       inside ``save(S)``, mid-copy into shared memory, once every other rank saved S;
``after_save``    right after its ``save(S)`` returned, once every other rank saved S.

torchrun stops the others and relaunches the job once. Per job: the step R every rank restored and
where from (``ckpt.last_restore.source``: memory or storage), steps lost = S - R (a kill inside S
loses at least that step: 1; after ``save(S)`` returned, 0), and the time from the kill to the
restarted job's first training step (the killed rank's ``kill.json``, written just before the
SIGKILL, to the newest of the ranks' ``restored-1.pt``, written right before the training loop), with
the restore's own seconds (the slowest rank's ``last_restore.seconds``). A job that does not exit 0
is reported with its log's tail.

Every rank runs through this script (``--rank``), which prints where ``mpckpt`` was imported from
and then runs the worker as ``__main__``: ``--pythonpath TREE`` puts TREE first on the ranks'
``PYTHONPATH``, so one invocation measures another tree's mpckpt (an old commit's ``git archive``,
say) with this checkout's worker. Snapshots kept in /dev/shm for the bench's roots are removed after
each job, by the same tree's ``mpckpt._keep.store``.

    .venv/bin/python bench/kill_moments.py --worlds 2,3 --reps 2
    .venv/bin/python bench/kill_moments.py --worlds 2 --pythonpath /tmp/mpckpt-before --json /tmp/km-before.json
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

BENCH_DIR = Path(__file__).resolve().parent
REPO_DIR = BENCH_DIR.parent
WORKER = REPO_DIR / "tests" / "integration" / "job_kill_worker.py"
MOMENTS = ("forward", "before_optim", "in_save", "after_save")
STEPS, KILL_STEP, STORAGE_EVERY, BLOB_MB, BUDGET = 10, 7, 5, 32, "160MiB"  # as test_job_memory_kills
JOB_TIMEOUT_S = 240
IMPORTED = "kill_moments: mpckpt from "
CLEANUP = """
import sys
from mpckpt._keep import store
for kept in store.list_kept():
    if kept.root is not None and kept.root.startswith(sys.argv[1]) and not kept.held:
        store.remove_kept(kept.base)
"""


def run_rank(argv: list[str]) -> None:
    """One rank: say which mpckpt it imports, then run the worker as ``__main__`` with ``argv``."""
    import runpy

    import mpckpt

    print(IMPORTED + mpckpt.__file__, file=sys.stderr, flush=True)
    sys.argv = [str(WORKER), *argv]
    runpy.run_path(str(WORKER), run_name="__main__")


def env_for(pythonpath: str | None) -> dict[str, str]:
    """The ranks' environment: ``pythonpath`` (then this checkout, for ``tests``) first on ``PYTHONPATH``."""
    paths = [p for p in (pythonpath, str(REPO_DIR)) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
                 "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)
    return {k: v for k, v in env.items() if not k.startswith("MPCKPT_")}


def run_job(tmp: Path, world: int, moment: str, env: dict[str, str]) -> tuple[int, Path]:
    """One torchrun job with a kill at ``moment``: its exit code and log."""
    kill_rank = 1 if world == 2 else 0
    log = tmp / "log.txt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           "--max-restarts=1", str(Path(__file__).resolve()), "--rank", str(tmp / "root"), str(tmp / "out"),
           "--model", "ddp", "--steps", str(STEPS), "--storage-every", str(STORAGE_EVERY), "--blob-mb", str(BLOB_MB),
           "--budget", BUDGET, "--moment", moment, "--kill-rank", str(kill_rank), "--kill-step", str(KILL_STEP)]
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, cwd=REPO_DIR, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        code = proc.wait(JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait(15)
        code = -9
    return code, log


def read_job(out: Path, world: int, code: int) -> dict[str, Any]:
    """What one job's files say: the kill, the restore on the second attempt, the times; an ``error`` when a
    file the job should have written is missing or unreadable."""
    row: dict[str, Any] = {"exit": code}
    try:
        return read_files(out, world, row)
    except (OSError, ValueError, KeyError, IndexError) as e:
        return {**row, "error": f"{type(e).__name__}: {e}"}


def read_files(out: Path, world: int, row: dict[str, Any]) -> dict[str, Any]:
    kills = [(r, json.loads(p.read_text())) for r in range(world) if (p := out / f"rank{r}" / "kill.json").exists()]
    if len(kills) != 1:
        row["error"] = f"{len(kills)} ranks wrote kill.json"
        return row
    rank, kill = kills[0]
    restored = [out / f"rank{r}" / "restored-1.json" for r in range(world)]
    if not all(p.exists() for p in restored):
        row["error"] = "no restore on the second attempt"
        return row
    docs = [json.loads(p.read_text()) for p in restored]
    steps = {d["step"] for d in docs}
    sources = sorted({str(d["source"]) for d in docs})
    killed_at = (out / f"rank{rank}" / "kill.json").stat().st_mtime
    training = max((out / f"rank{r}" / "restored-1.pt").stat().st_mtime for r in range(world))
    step = docs[0]["step"]
    saved = [[int(line.split()[1]) for line in (out / f"rank{r}" / "trace").read_text().split("\n")
              if line.startswith("saved ")] for r in range(world)]
    row.update(killed_rank=rank, S=kill["step"], mid_copy=kill.get("mid_copy"),
               newest_every_rank=min(s[-1] if s else -1 for s in saved), R=step if len(steps) == 1 else sorted(steps),
               source="/".join(sources), lost=kill["step"] - step if len(steps) == 1 and step is not None else None,
               restart_s=training - killed_at, restore_s=max(d["seconds"] or 0.0 for d in docs),
               exact=len(steps) == 1 and step is not None and restored_exact(out, world, step))
    return row


def same(a: Any, b: Any) -> bool:
    """Whether two saved local states (``job_kill_worker.local_state``) are equal bit for bit."""
    import torch

    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and \
            bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    return bool(a == b)


def restored_exact(out: Path, world: int, step: int) -> bool:
    """Every rank's state right after the restore is the one it saved at ``step`` on the first attempt."""
    import torch

    return all(same(torch.load(out / f"rank{r}" / "restored-1.pt"), torch.load(out / f"rank{r}" / f"state-{step}.pt"))
               for r in range(world))


def cleanup(root: Path, env: dict[str, str]) -> None:
    subprocess.run([sys.executable, "-c", CLEANUP, str(root)], env=env, cwd=REPO_DIR, check=False)


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in rows if "error" not in r and r["exit"] == 0]
    join = lambda key: ", ".join(sorted({str(r[key]) for r in ok}))  # noqa: E731
    return {"jobs": len(rows), "ok": len(ok), "S": join("S"), "R": join("R"), "source": join("source"),
            "lost": join("lost"), "newest_every_rank": join("newest_every_rank"),
            "exact": sum(bool(r["exact"]) for r in ok),
            "restart_s": statistics.median(r["restart_s"] for r in ok) if ok else None,
            "restore_s": statistics.median(r["restore_s"] for r in ok) if ok else None}


def table(results: list[dict[str, Any]]) -> str:
    head = ("| ranks | moment | S (killed in) | newest step every rank saved | R (restored) | from | steps lost S - R "
            "| restored state exact | kill to training again s (median) | restore s (median) | jobs ok |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        s = r["summary"]
        restart = f"{s['restart_s']:.1f}" if s["restart_s"] is not None else "-"
        restore = f"{s['restore_s']:.2f}" if s["restore_s"] is not None else "-"
        lines.append(f"| {r['world']} | {r['moment']} | {s['S']} | {s['newest_every_rank']} | {s['R']} | {s['source']} "
                     f"| {s['lost']} | {s['exact']}/{s['ok']} | {restart} | {restore} | {s['ok']}/{s['jobs']} |")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        return run_rank(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worlds", default="2", help="rank counts, comma-separated")
    p.add_argument("--moments", default=",".join(MOMENTS))
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--pythonpath", help="a tree whose mpckpt the ranks import (default: this checkout's)")
    p.add_argument("--json", help="write every job's row and the summaries here")
    args = p.parse_args()
    env = env_for(os.path.abspath(args.pythonpath) if args.pythonpath else None)
    results, seen_import = [], False
    for world in (int(w) for w in args.worlds.split(",")):
        for moment in args.moments.split(","):
            rows = []
            for rep in range(args.reps):
                tmp = Path(tempfile.mkdtemp(prefix=f"kill-moments-{moment}{world}-"))
                try:
                    t0 = time.monotonic()
                    code, log = run_job(tmp, world, moment, env)
                    row = read_job(tmp / "out", world, code)
                    row["job_s"] = time.monotonic() - t0
                    text = log.read_text(errors="replace")
                    if not seen_import:
                        print(next((ln for ln in text.split("\n") if IMPORTED in ln), "(no import line)"),
                              file=sys.stderr)
                        seen_import = True
                    if code != 0 or "error" in row:
                        row["log_tail"] = text[-3000:]
                    print(f"[kill_moments] {world} ranks, {moment}, rep {rep}: {row}",
                          file=sys.stderr, flush=True)
                    rows.append(row)
                finally:
                    cleanup(tmp / "root", env)
                    shutil.rmtree(tmp, ignore_errors=True)
            results.append({"world": world, "moment": moment, "rows": rows, "summary": summarize(rows)})
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps({"command": " ".join(sys.argv), "pythonpath": args.pythonpath,
                                               "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "results": results},
                                              indent=1))


if __name__ == "__main__":
    main()
