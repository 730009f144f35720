"""mpckpt.integrations.ray inside a real Ray Train TorchTrainer: 2 CPU workers under gloo, one multi-rank job.

Each test runs ``TorchTrainer.fit()`` on a local Ray (``ray.init(num_cpus=2)``): the workers open
one Checkpointer in Ray's experiment folder (collective open), ``report`` every step, and the
driver checks what Ray's ``Result`` says against what is on disk and what ``mpckpt.load`` reads.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")

import mpckpt  # noqa: E402
from mpckpt.format.names import step_of  # noqa: E402

LOSSES = [5.0, 1.0, 4.0, 0.5, 3.0, 2.0]


@pytest.fixture(scope="module")
def ray_local() -> Any:
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             _node_ip_address="127.0.0.1")
    try:
        yield ray
    finally:
        ray.shutdown()


def _train(config: dict[str, Any]) -> None:
    """Every worker: restore, then a step of 'training' (weights := step) and a report per step."""
    import ray.train
    import torch

    from mpckpt.integrations import ray as mray
    from tests.waiting import wait_until

    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    known_at_start = ray.train.get_checkpoint()
    model = torch.nn.Linear(64, 64)
    state = {"model": model, "step": -1}
    log: list[dict[str, Any]] = []
    with mray.open_checkpointer(workers=1, memory_budget="256MiB", timeout_s=60) as ckpt:
        restored = mray.restore(ckpt, state)
        log.append({"restored": restored, "ray_knew": None if known_at_start is None else known_at_start.path,
                    "world": ctx.get_world_size(), "group": torch.distributed.is_initialized()})
        for step in range(0 if restored is None else restored + 1, config["steps"]):
            with torch.no_grad():
                model.weight.fill_(float(step))
                model.bias.fill_(-float(step))
            state["step"] = step
            metrics = {"loss": config["losses"][step], "step": step}
            if known_at_start is None and step == config.get("crash_at"):
                # committed by mpckpt, never reported to Ray: the restart must adopt it
                ckpt.save(step, state, metrics=metrics, mode="sync")
                raise RuntimeError(f"injected failure at step {step}")
            future = mray.report(ckpt, step, state, metrics)
            log.append({"step": step, "blocked_ms": future.stats.blocked_ms})
        ckpt.wait()
        log.append({"steps_listed": ckpt.steps(), "latest": ckpt.latest_step})
        if config.get("check_forget"):
            # Ray deletes step 0 once it holds 3 checkpoints; the Checkpointer must stop listing it
            first = os.path.join(mray.experiment_root(), "step_0000000000")
            wait_until(lambda: not os.path.exists(first), 60, "Ray deleting step 0", poll_s=0.1)
            listed_before = ckpt.steps()
            forgotten = mray._forget_deleted(ckpt)
            log.append({"before": listed_before, "forgotten": forgotten, "after": ckpt.steps()})
    if rank == 0:
        with open(os.path.join(config["logdir"], f"attempt_{os.getpid()}.json"), "w") as f:
            json.dump(log, f)


def _fit(tmp_path: Any, name: str, *, steps: int, num_to_keep: int | None, crash_at: int | None = None,
         max_failures: int = 0, check_forget: bool = False) -> Any:
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    logdir = tmp_path / f"{name}_log"
    logdir.mkdir()
    trainer = TorchTrainer(
        _train,
        train_loop_config={"steps": steps, "losses": LOSSES, "crash_at": crash_at, "logdir": str(logdir),
                           "check_forget": check_forget},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(
            name=name, storage_path=str(tmp_path / "ray_results"),
            checkpoint_config=CheckpointConfig(num_to_keep=num_to_keep, checkpoint_score_attribute="loss",
                                               checkpoint_score_order="min"),
            failure_config=FailureConfig(max_failures=max_failures),
        ),
    )
    result = trainer.fit()
    logs = [json.loads(p.read_text()) for p in sorted(logdir.iterdir())]
    return result, logs


def _step(path: str) -> int | None:
    return step_of(str(path).rstrip("/").rpartition("/")[2])


def _folders(root: Any) -> set[int]:
    return {s for s in (step_of(p.name) for p in root.iterdir()) if s is not None} if root.exists() else set()


def _expect_state(state: dict[str, Any], step: int) -> None:
    assert state["step"] == step
    assert torch.equal(state["model"]["weight"], torch.full((64, 64), float(step)))
    assert torch.equal(state["model"]["bias"], torch.full((64,), -float(step)))


def test_result_best_checkpoints_and_num_to_keep(ray_local: Any, tmp_path: Any) -> None:
    result, logs = _fit(tmp_path, "keep", steps=6, num_to_keep=2, check_forget=True)
    assert result.error is None
    root = tmp_path / "ray_results" / "keep" / "mpckpt"
    # Ray's latest is the last committed mpckpt checkpoint, and it loads
    assert result.checkpoint is not None
    assert os.path.realpath(os.path.dirname(result.checkpoint.path)) == os.path.realpath(root)
    assert _step(result.checkpoint.path) == 5
    _expect_state(mpckpt.load(result.checkpoint.path), 5)
    # num_to_keep=2 by loss (min): the best are steps 3 (0.5) and 1 (1.0); Ray also keeps its latest (5)
    best = {_step(c.path): m for c, m in result.best_checkpoints}
    assert set(best) == {1, 3}
    assert best[3]["loss"] == 0.5 and best[1]["loss"] == 1.0
    # Ray deleted 0, 2 and 4: what is on disk and what mpckpt lists are what Ray keeps
    assert _folders(root) == {1, 3, 5}
    with mpckpt.Checkpointer(str(root), read_only=True) as view:
        assert view.steps() == [1, 3, 5]
        assert view.best(1, "loss", "min") == [3]
        for s in (1, 3, 5):
            _expect_state(view.load(s), s)
    # both workers were ranks of one torch.distributed job; the save returned before the commit
    (log,) = logs
    assert log[0] == {"restored": None, "ray_knew": None, "world": 2, "group": True}
    assert [e["step"] for e in log if "step" in e] == list(range(6))
    assert log[-2]["latest"] == 5
    # the live Checkpointer stops listing what Ray deleted (checked on rank 0 once step 0 was gone)
    forget = log[-1]
    assert 0 not in forget["after"] and {1, 3, 5} <= set(forget["after"]) <= set(forget["before"]) | {5}
    assert 5 not in forget["forgotten"]


def test_keep_everything_without_num_to_keep(ray_local: Any, tmp_path: Any) -> None:
    result, _ = _fit(tmp_path, "all", steps=3, num_to_keep=None)
    root = tmp_path / "ray_results" / "all" / "mpckpt"
    assert sorted(_step(c.path) for c, _ in result.best_checkpoints) == [0, 1, 2] == sorted(_folders(root))
    _expect_state(mpckpt.load(str(root)), 2)


def test_restart_resumes_from_latest_commit(ray_local: Any, tmp_path: Any) -> None:
    """A worker group failure after step 3 was committed but before Ray heard of it: the restart
    reports step 3 to Ray, restores it and goes on from step 4."""
    result, logs = _fit(tmp_path, "restart", steps=6, num_to_keep=None, crash_at=3, max_failures=1)
    assert result.error is None
    assert len(logs) == 1  # only the second attempt finished (the first one raised)
    (log,) = logs
    assert log[0]["restored"] == 3 and log[0]["ray_knew"] is not None and _step(log[0]["ray_knew"]) in (0, 1, 2)
    assert [e["step"] for e in log if "step" in e] == [4, 5]
    root = tmp_path / "ray_results" / "restart" / "mpckpt"
    assert _step(result.checkpoint.path) == 5
    _expect_state(mpckpt.load(result.checkpoint.path), 5)
    steps = sorted(_step(c.path) for c, _ in result.best_checkpoints)
    assert steps == [0, 1, 2, 3, 4, 5] == sorted(_folders(root))
    adopted = dict((_step(c.path), m) for c, m in result.best_checkpoints)[3]
    assert adopted["loss"] == LOSSES[3]


def _misuse(config: dict[str, Any]) -> None:
    import ray.train

    import mpckpt
    from mpckpt.integrations import ray as mray

    errors = []
    state = {"x": 1}
    for options in ({"root": config["outside"]}, {"keep_last": 2}):
        root = options.pop("root", mray.experiment_root(f"misuse_{len(errors)}"))
        with mpckpt.Checkpointer(root, workers=1, memory_budget="64MiB", **options) as ckpt:
            try:
                mray.report(ckpt, 0, state, {"loss": 1.0})
            except mpckpt.errors.ConfigError as e:
                errors.append(str(e))
            assert ckpt.steps() == []  # refused before anything was saved
    if ray.train.get_context().get_world_rank() == 0:
        with open(config["errors"], "w") as f:
            json.dump(errors, f)


def test_misuse_is_refused_before_saving(ray_local: Any, tmp_path: Any) -> None:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    errors = tmp_path / "errors.json"
    trainer = TorchTrainer(_misuse, train_loop_config={"outside": str(tmp_path / "elsewhere"), "errors": str(errors)},
                           scaling_config=ScalingConfig(num_workers=2),
                           run_config=RunConfig(name="misuse", storage_path=str(tmp_path / "ray_results")))
    assert trainer.fit().error is None
    outside, keep = json.loads(errors.read_text())
    assert "outside Ray Train's experiment folder" in outside
    assert "retention belongs to Ray" in keep
