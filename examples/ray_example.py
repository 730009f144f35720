"""Ray Train + mpckpt: asynchronous checkpoints from a TorchTrainer, managed by Ray.

    .venv/bin/python examples/ray_example.py [--steps 20] [--storage /tmp/ray_results]

Two CPU workers train a small model under DDP (gloo). Every step each worker calls
``mpckpt.integrations.ray.report`` instead of ``ray.train.report``: it returns once the state
is in shared memory; mpckpt's uploader processes commit it, and Ray is told about the
committed checkpoint (``<experiment>/mpckpt/step_N``) in report order. Ray's
``CheckpointConfig`` keeps the 2 best by loss (and its latest); ``FailureConfig`` restarts the
workers once after an error, and they resume from the latest commit.
"""

from __future__ import annotations

import argparse
import tempfile
from typing import Any


def train_func(config: dict[str, Any]) -> None:
    import ray.train
    import ray.train.torch
    import torch

    from mpckpt.integrations import ray as mray

    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    state = {"model": model, "optim": opt}
    rank = ray.train.get_context().get_world_rank()
    with mray.open_checkpointer(workers=1) as ckpt:      # every worker: one multi-rank Checkpointer
        last = mray.restore(ckpt, state)                # the latest commit after a restart, else None
        for step in range(0 if last is None else last + 1, config["steps"]):
            g = torch.Generator().manual_seed(step * 100 + rank)
            x = torch.randn(64, 32, generator=g)
            loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            mray.report(ckpt, step, state, {"loss": float(loss), "step": step})
    # leaving the block waited for the last commits; Ray reports them before the run ends


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--storage", default=None, help="RunConfig(storage_path=...); default: a temp folder")
    args = parser.parse_args()

    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    import mpckpt

    ray.init(num_cpus=2, include_dashboard=False)
    try:
        trainer = TorchTrainer(
            train_func,
            train_loop_config={"steps": args.steps},
            scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
            run_config=RunConfig(
                name="mpckpt_example",
                storage_path=args.storage or tempfile.mkdtemp(prefix="ray_results_"),
                checkpoint_config=CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="loss",
                                                   checkpoint_score_order="min"),
                failure_config=FailureConfig(max_failures=1),
            ),
        )
        result = trainer.fit()
    finally:
        ray.shutdown()
    print("latest checkpoint:", result.checkpoint.path)
    for checkpoint, metrics in result.best_checkpoints:
        print(f"  best: {checkpoint.path}  loss={metrics['loss']:.4f}")
    state = mpckpt.load(result.checkpoint.path)          # plain tensors, no Ray, no objects needed
    print("loaded keys:", sorted(state["model"]))


if __name__ == "__main__":
    main()
