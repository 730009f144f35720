"""mpckpt's own share of a restart: import, open, restore, the first saves, at a realistic size.

A 2-rank DDP job (torchrun, gloo, CPU; the MLP of ``bench/goodput.py --realistic``: ~1.2 GB of state
per rank) saves to memory every step and to storage every ``--every`` steps, then every rank dies at
once (``os._exit``: no close, the kept snapshots stay in /dev/shm) and torchrun is started again,
``--restarts`` times. Each attempt times, per rank, what mpckpt adds to the restart: the lazy import
of ``mpckpt.Checkpointer``, the open (``Checkpointer(...)``), the restore (and where from), the loop's
time in the first save after the restore (one due to storage) and in the next (to memory), and how
long after the open the uploader processes were up (their pids answered, asked from a thread). The model's build and
torch's import are timed beside them for scale. Storage: a moto S3 server started here, or a folder
on disk.

    .venv/bin/python bench/restart_share.py --storage s3 --restarts 3
    .venv/bin/python bench/restart_share.py --storage disk --width 512 --depth 4   # small and quick

Prints a table of medians over the restarts (both ranks) and writes ``--json``.
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
import threading
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_DIR = HERE.parent
PHASES = ("torch_import", "build", "mpckpt_import", "open", "restore", "first_due_save", "first_save",
          "uploaders_up")


def rank_main() -> None:
    """One rank of one attempt (under torchrun): train, save, time the restart's parts, die or close."""
    began = time.time()
    import torch

    sys.path.insert(0, str(REPO_DIR))
    from harness.job import IN, OUT_DIM, init_group, parallel, train_step

    imported = time.time()
    torch.set_num_threads(1)
    rank, world = init_group()
    cfg = json.loads(os.environ["SHARE_CONFIG"])
    t = time.time()
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(IN, cfg["width"]), torch.nn.ReLU()]
    for _ in range(cfg["depth"] - 2):
        layers += [torch.nn.Linear(cfg["width"], cfg["width"]), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(cfg["width"], OUT_DIM))
    model, opt = parallel(torch.nn.Sequential(*layers), "ddp", world)
    state = {"model": model, "optim": opt}
    out = {"torch_import": imported - began, "build": time.time() - t}
    t = time.time()
    import mpckpt

    checkpointer_class = mpckpt.Checkpointer
    out["mpckpt_import"] = time.time() - t
    t = time.time()
    ckpt = checkpointer_class(cfg["root"], storage_options=cfg["options"], keep_last=3, workers=1,
                              memory_budget=cfg["budget"], preemption=True)
    opened = time.time()
    out["open"] = opened - t
    t = time.time()
    profile = None
    if os.environ.get("SHARE_PROFILE") and rank == 0:  # the restore's profile on rank 0's stderr
        import cProfile

        profile = cProfile.Profile()
        profile.enable()
    restored = ckpt.restore(state)
    out["restore"] = time.time() - t
    if profile is not None:
        import pstats

        profile.disable()
        pstats.Stats(profile, stream=sys.stderr).sort_stats("cumulative").print_stats(35)
    out["restored"] = restored
    out["source"] = ckpt.last_restore.source if ckpt.last_restore is not None else None
    step = 0 if restored is None else restored + 1
    up: dict[str, float] = {}

    def uploaders_up() -> None:  # asking for their pids waits for their start: off the loop, as a watcher would
        ckpt.uploader_pids  # noqa: B018
        up["at"] = time.time() - opened

    for i in range(cfg["steps"]):
        train_step(model, opt, step, rank, batch=cfg["batch"])
        due = i == 0 or step % cfg["every"] == 0  # the first save after the restore goes to storage
        t = time.time()
        ckpt.save(step, state, mode="async" if due else "memory")
        out["first_due_save" if i == 0 else "first_save" if i == 1 else "later_save"] = time.time() - t
        if i == 0:
            watcher = threading.Thread(target=uploaders_up, daemon=True)
            watcher.start()
        step += 1
    watcher.join(300)
    out["uploaders_up"] = up.get("at")
    ckpt.wait(600)  # the last due save committed: the next attempt restores it or a newer kept one
    with open(Path(cfg["out"]) / f"r{rank}.json", "w") as f:
        json.dump(out, f)
    if cfg["die"]:
        os._exit(1)  # every rank at once: no close, the kept snapshots stay
    ckpt.close()


def attempt(args: argparse.Namespace, root: str, options: dict | None, work: Path, number: int, die: bool,
            port: int) -> list[dict]:
    out = work / f"attempt{number}"
    out.mkdir(parents=True)
    cfg = {"root": root, "options": options, "width": args.width, "depth": args.depth, "batch": args.batch,
           "budget": args.budget, "every": args.every, "steps": args.every + 1 if number else args.every + 2,
           "out": str(out), "die": die}
    env = {**os.environ, "SHARE_CONFIG": json.dumps(cfg), "PYTHONPATH": str(REPO_DIR)}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-id", "share",
                "--master-port", str(port), str(Path(__file__).resolve()), "--rank-main"]
    done = subprocess.run(torchrun, env=env, capture_output=True, text=True, timeout=args.timeout_s)
    if os.environ.get("SHARE_PROFILE"):
        print(done.stderr[-12000:], file=sys.stderr)
    results = []
    for rank in range(2):
        path = out / f"r{rank}.json"
        if not path.exists():
            raise RuntimeError(f"attempt {number}: rank {rank} wrote nothing; torchrun said:\n{done.stderr[-4000:]}")
        results.append(json.loads(path.read_text()))
    return results


def main() -> None:
    if "--rank-main" in sys.argv:
        return rank_main()
    sys.path.insert(0, str(REPO_DIR))
    sys.path.insert(0, str(HERE))
    from harness.servers import free_port, s3_options, stop_server

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--storage", choices=["s3", "disk"], default="s3")
    parser.add_argument("--restarts", type=int, default=3)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--every", type=int, default=5, help="a storage save every N steps")
    parser.add_argument("--budget", default="3GiB")
    parser.add_argument("--timeout-s", type=float, default=600)
    parser.add_argument("--json", default=str(HERE / "results" / "restart_share.json"))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="restart-share-", dir=os.environ.get("TMPDIR")))
    moto = None
    try:
        if args.storage == "s3":
            import s3fs
            from peer_recovery import start_moto

            moto, endpoint = start_moto(str(work))
            options = s3_options(endpoint)
            bucket = f"share-{uuid.uuid4().hex[:8]}"
            s3fs.S3FileSystem(**options, skip_instance_cache=True).mkdir(bucket)
            root = f"s3://{bucket}/run"
        else:
            options, root = None, str(work / "root")
        port = free_port()
        # the last attempt closes: nothing of it stays in /dev/shm
        runs = [attempt(args, root, options, work, n, die=n < args.restarts, port=port)
                for n in range(args.restarts + 1)]
    finally:
        if moto is not None:
            stop_server(moto)
        shutil.rmtree(work, ignore_errors=True)
    restarts = [r for run in runs[1:] for r in run]
    table = {p: statistics.median(r[p] for r in restarts if r.get(p) is not None) for p in PHASES}
    sources = sorted({str(r["source"]) for r in restarts})
    result = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "storage": args.storage,
              "medians_s": table, "sources": sources, "attempts": runs}
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(f"storage {args.storage}, {args.restarts} restarts x 2 ranks, restored from {', '.join(sources)}")
    print("| " + " | ".join(PHASES) + " |\n|" + "---:|" * len(PHASES))
    print("| " + " | ".join(f"{table[p]:.3f}" for p in PHASES) + " |")
    print(f"results: {args.json}")


if __name__ == "__main__":
    main()
