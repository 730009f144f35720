"""Ray Train checkpointing: Ray's own ASYNC upload vs mpckpt, inside the same TorchTrainer.

Usage::

    .venv/bin/python bench/ray_bench.py [--gib 1.0] [--steps 8] [--every 1] [--workers 2] [--cpus 2]
                                        [--cases none,ray_async,mpckpt] [--out bench/results/ray_bench.json]

One local Ray (``ray.init(num_cpus=--cpus)``), one ``TorchTrainer`` per case with ``--workers``
CPU workers under gloo (DDP: every worker holds the whole state). The state is a stack of
``nn.Linear`` layers + Adam whose parameters and both moments come to ``--gib`` GiB; each step
is forward, backward, ``optimizer.step()`` (DDP all-reduce), and every ``--every`` steps a
checkpoint:

- ``none``: no checkpoint and no per-step report: the training loop alone. (A metrics-only
  ``ray.train.report`` blocks too, on Ray's result queue: about 1.2 s per call here.)
- ``ray_async``: what Ray's docs and PR #55637 show: rank 0 ``torch.save``s the state into a
  fresh local folder and every rank calls ``ray.train.report(checkpoint=...,
  checkpoint_upload_mode=ASYNC)``; Ray copies the folder into ``storage_path`` in a thread
  and deletes the local one.
- ``mpckpt``: ``mpckpt.integrations.ray.report(ckpt, step, state, metrics)`` on every rank; one
  multi-rank Checkpointer in the experiment folder (each rank writes half of the replicated
  tensors), committed by its uploader processes, and handed to Ray when committed.

Measured on every rank: the time each report call blocks the training loop ("blocked"), the
step time (train step + report), and for the whole run the wall time of ``trainer.fit()`` and
the time from the last report to the end of ``fit()`` (what is left to persist). Results are
printed as a table and written as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

GIB = 1 << 30


def _workload(gib: float, hidden: int = 2048, batch: int = 16) -> tuple[Any, Any, Any, Any]:
    import torch
    from torch import nn

    per_layer = (hidden * hidden + hidden) * 4 * 3  # params + Adam exp_avg + exp_avg_sq, fp32
    layers = max(1, round(gib * GIB / per_layer))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(hidden, hidden) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x, y = torch.randn(batch, hidden), torch.randn(batch, hidden)
    return model, opt, x, y


def _train(config: dict[str, Any]) -> None:
    import ray.train
    import ray.train.torch
    import torch

    torch.set_num_threads(max(1, config["cpus"] // config["workers"]))
    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    model, opt, x, y = _workload(config["gib"])
    model = ray.train.torch.prepare_model(model)  # DDP over gloo
    state = {"model": model, "optim": opt, "step": 0}

    def train_step() -> float:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return float(loss.detach())

    train_step()  # Adam state exists before the first checkpoint, as in a real run
    blocked, steps, train, saving = [], [], [], []
    ckpt = None
    setup_started = time.perf_counter()
    if config["case"] == "mpckpt":
        from mpckpt.integrations import ray as mray

        ckpt = mray.open_checkpointer(workers=config["uploaders"])
        ckpt.prepare(state)  # warm shared memory for the first save (restore() does this too)
    local_root = os.path.join(config["logdir"], f"local_rank{rank}")  # the driver removes logdir after fit()
    os.makedirs(local_root, exist_ok=True)
    started = time.perf_counter()
    setup_s = started - setup_started  # mpckpt: the collective open (uploaders started) and prepare()
    for step in range(config["steps"]):
        t0 = time.perf_counter()
        loss = train_step()
        t1 = time.perf_counter()
        state["step"] = step
        metrics = {"loss": loss, "step": step}
        save_s = 0.0
        if (step + 1) % config["every"]:
            steps.append(t1 - t0)
            train.append(t1 - t0)
            continue  # not a checkpoint step
        if config["case"] == "none":
            pass  # no checkpoint, and no per-step ray.train.report (whose result queue may block)
        elif config["case"] == "ray_async":
            from ray.train import Checkpoint, CheckpointUploadMode

            checkpoint = None
            if rank == 0:
                folder = os.path.join(local_root, f"step_{step}")
                os.makedirs(folder)
                torch.save({"model": model.module.state_dict(), "optim": opt.state_dict(), "step": step},
                           os.path.join(folder, "state.pt"))
                save_s = time.perf_counter() - t1
                checkpoint = Checkpoint.from_directory(folder)
            ray.train.report(metrics, checkpoint=checkpoint, checkpoint_upload_mode=CheckpointUploadMode.ASYNC)
        else:
            from mpckpt.integrations import ray as mray

            assert ckpt is not None
            future = mray.report(ckpt, step, state, metrics)
            save_s = future.stats.blocked_ms / 1e3
        t2 = time.perf_counter()
        blocked.append(t2 - t1)
        saving.append(save_s)
        train.append(t1 - t0)
        steps.append(t2 - t0)
    loop_s = time.perf_counter() - started
    if ckpt is not None:
        ckpt.close()  # waits for the last commits
    end_s = time.perf_counter() - started
    # local_root stays: Ray's upload threads may still copy the last folder after this returns
    out = {"rank": rank, "blocked_s": blocked, "save_s": saving, "train_s": train, "step_s": steps, "loop_s": loop_s,
           "train_fn_s": end_s, "end_unix": time.time(),
           "setup_s": setup_s}
    with open(os.path.join(config["logdir"], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


def run_case(case: str, args: argparse.Namespace, storage: str) -> dict[str, Any]:
    from ray.train import CheckpointConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    logdir = tempfile.mkdtemp(prefix=f"ray_bench_{case}_")
    config = {"case": case, "gib": args.gib, "steps": args.steps, "workers": args.workers, "cpus": args.cpus,
              "uploaders": args.uploaders, "logdir": logdir, "every": args.every}
    trainer = TorchTrainer(
        _train, train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=False),
        run_config=RunConfig(name=f"bench_{case}", storage_path=storage,
                             checkpoint_config=CheckpointConfig(num_to_keep=args.keep)),
    )
    started = time.perf_counter()
    result = trainer.fit()
    fit_s = time.perf_counter() - started
    fit_end = time.time()
    ranks = [json.load(open(os.path.join(logdir, n))) for n in sorted(os.listdir(logdir)) if n.endswith(".json")]
    shutil.rmtree(logdir, ignore_errors=True)
    blocked = [b for r in ranks for b in r["blocked_s"]] or [0.0]
    row = {
        "case": case,
        "fit_s": fit_s,
        "setup_s": max(r["setup_s"] for r in ranks),
        "loop_s": max(r["loop_s"] for r in ranks),
        "tail_s": max(fit_end - r["end_unix"] + (r["train_fn_s"] - r["loop_s"]) for r in ranks),
        "blocked_median_s": statistics.median(blocked),
        "blocked_max_s": max(blocked),
        "blocked_total_s": max(sum(r["blocked_s"]) for r in ranks),
        "blocked_rank0_s": ranks[0]["blocked_s"],
        "save_median_s": statistics.median(s for r in ranks for s in r["save_s"] if s > 0) if any(
            s > 0 for r in ranks for s in r["save_s"]) else 0.0,
        "train_median_s": statistics.median(t for r in ranks for t in r["train_s"]),
        "step_median_s": statistics.median(t for r in ranks for t in r["step_s"]),
        "checkpoint": None if result.checkpoint is None else result.checkpoint.path,
        "error": None if result.error is None else repr(result.error),
    }
    if case == "mpckpt" and result.checkpoint is not None:  # the result loads
        import mpckpt

        loaded = mpckpt.load(result.checkpoint.path)
        row["loaded_step"] = loaded["step"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="state size (params + Adam moments), GiB")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--every", type=int, default=1, help="a checkpoint every N steps")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--cpus", type=int, default=2, help="ray.init(num_cpus=...)")
    parser.add_argument("--uploaders", type=int, default=1, help="mpckpt uploader processes per worker")
    parser.add_argument("--keep", type=int, default=2, help="CheckpointConfig(num_to_keep=...)")
    parser.add_argument("--cases", default="none,ray_async,mpckpt")
    parser.add_argument("--storage", default=None, help="RunConfig(storage_path=...); default: a temp folder")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                      "ray_bench.json"))
    args = parser.parse_args()

    import ray

    storage = args.storage or tempfile.mkdtemp(prefix="ray_bench_storage_")
    ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False, configure_logging=False,
             _node_ip_address="127.0.0.1")
    rows = []
    try:
        for case in args.cases.split(","):
            row = run_case(case, args, storage)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "blocked_rank0_s"}), file=sys.stderr)
    finally:
        ray.shutdown()
        if args.storage is None:
            shutil.rmtree(storage, ignore_errors=True)
    print(f"\nRay Train, {args.workers} CPU workers (gloo DDP), ray.init(num_cpus={args.cpus}), state {args.gib} GiB, "
          f"{args.steps} steps, a checkpoint every {args.every} step(s), num_to_keep={args.keep}\n")
    print("| case | blocked per report, median (max) | of which saving, median | train step, median | setup | loop "
          "| after last report | fit() total |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['blocked_median_s'] * 1e3:.0f} ms ({r['blocked_max_s'] * 1e3:.0f} ms) | "
              f"{r['save_median_s'] * 1e3:.0f} ms | {r['train_median_s'] * 1e3:.0f} ms | {r['setup_s']:.1f} s | "
              f"{r['loop_s']:.1f} s | {r['tail_s']:.1f} s | {r['fit_s']:.1f} s |")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    print(f"\nwritten: {args.out}")


if __name__ == "__main__":
    main()
