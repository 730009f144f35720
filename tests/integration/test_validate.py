"""validate=: a function run on each committed checkpoint in a process of its own, its metrics joined."""

from __future__ import annotations

import functools
import json
import logging
import os
import time

import pytest

import mpckpt
from mpckpt.checkpoint import Checkpoint
from mpckpt.cli import main
from mpckpt.errors import ConfigError, StepOrderError, ValidationError, WaitTimeoutError
from tests.integration.test_remote import backend, remote, server  # noqa: F401 -- fixtures: moto S3, Azurite
from tests.states import filled_state
from tests.waiting import poll_until

# val_loss of each step's state: w is filled with it
VAL = {1: 3.0, 2: 1.0, 3: 2.0, 4: 1.0, 5: 2.0, 6: 3.0}


def state_of(step: int) -> dict:
    return filled_state(VAL.get(step, float(step)), (256,), step=step)


def evaluate(checkpoint: Checkpoint) -> dict:
    """A validate= function: loads the state it is given and scores it."""
    state = checkpoint.load()
    return {"val_loss": float(state["w"][0]), "pid": os.getpid()}


def gated(gate: str, checkpoint: Checkpoint) -> dict:
    """``evaluate``, once the file ``gate`` exists (so a test can hold validations back)."""
    poll_until(lambda: os.path.exists(gate), 60)  # (scores anyway after the bound: the test fails, never hangs)
    return evaluate(checkpoint)


def misbehave(plan: dict[int, str], checkpoint: Checkpoint) -> dict:
    what = plan.get(checkpoint.step or 0, "ok")
    if what == "raise":
        raise ValueError(f"no evaluation data for step {checkpoint.step}")
    if what == "bad":
        return {"val_loss": "high"}
    if what == "crash":
        os._exit(3)
    if what == "hang":
        time.sleep(60)  # the scenario: a validation that hangs (its deadline stops it)
    return evaluate(checkpoint)


def score_file(checkpoint: Checkpoint) -> dict:
    """validate= of directory checkpoints: reads a file the user wrote."""
    with checkpoint.as_directory() as folder, open(os.path.join(folder, "score.txt")) as f:
        return {"score": float(f.read())}


def folders(root) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.iterdir() if p.name.startswith("step_"))


def test_validation_metrics_join_the_checkpoint_in_another_process_and_persist(tmp_path, capsys):
    with mpckpt.Checkpointer(tmp_path, workers=1, validate=evaluate) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, state_of(step), metrics={"loss": 10.0 + step})
        ckpt.wait()  # returns once the validations are done too
        runs = ckpt.stats.validations
        assert [(v.step, v.status) for v in runs] == [(1, "ok"), (2, "ok"), (3, "ok")]  # commit order
        pids = {v.pid for v in runs}
        assert len(pids) == 1  # one long-lived validator process
        (pid,) = pids
        assert pid != os.getpid() and pid not in ckpt.uploader_pids
        assert all(v.metrics["pid"] == pid for v in runs)
        assert ckpt.checkpoint(2).metrics == {"loss": 12.0, "val_loss": 1.0, "pid": pid}
        assert ckpt.best(1, "val_loss") == [2] and ckpt.best(3, "val_loss", "max") == [1, 3, 2]
        uploaders = ckpt.uploader_pids
    assert pid not in uploaders

    # the manifest is never rewritten: the metrics live beside it, with a checksum of their own
    folder = tmp_path / "step_0000000002"
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["validate"] is True and manifest["metrics"] == {"loss": 12.0}
    assert json.loads((folder / "validation.json").read_text())["metrics"] == {"val_loss": 1.0, "pid": pid}

    # they survive reopening: a reader, a writer without validate=, mpckpt ls
    with mpckpt.Checkpointer(tmp_path, read_only=True) as reader:
        assert reader.best(1, "val_loss") == [2] and reader.checkpoint(3).metrics["val_loss"] == 2.0
    with mpckpt.Checkpointer(tmp_path, workers=1) as again:
        assert again.best(1, "val_loss") == [2] and again.stats.validations == []
    assert main(["ls", "--json", str(tmp_path)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["metrics"]["val_loss"], r["metrics"]["loss"]) for r in rows] == \
        [(1, 3.0, 11.0), (2, 1.0, 12.0), (3, 2.0, 13.0)]
    assert main(["ls", str(tmp_path)]) == 0
    assert '"val_loss": 1.0' in capsys.readouterr().out
    assert main(["verify", str(tmp_path)]) == 0


@pytest.mark.parametrize("keep_missing", [False, True])
def test_retention_keeps_checkpoints_whose_validation_is_pending(tmp_path, keep_missing):
    gate = tmp_path / "go"
    root = tmp_path / "run"
    keep = mpckpt.KeepBest(1, "val_loss", keep_missing=keep_missing)
    with mpckpt.Checkpointer(root, workers=1, keep=keep, validate=functools.partial(gated, str(gate))) as ckpt:
        for step in (1, 2, 3, 4):
            ckpt.save(step, state_of(step), mode="sync")  # committed; validations held back
        # without their metric KeepBest(1) keeps none of them, but none may go before it is known
        assert folders(root) == [1, 2, 3, 4] and ckpt.steps() == [1, 2, 3, 4]
        with pytest.raises(WaitTimeoutError, match="validations of steps"):
            ckpt.wait(timeout_s=0.5)
        with pytest.raises(StepOrderError, match=r"steps \[1\] are being validated"):
            ckpt.delete(1)  # by hand neither
        assert folders(root) == [1, 2, 3, 4]
        gate.touch()
        ckpt.wait()
        # val_loss 3, 1, 2, 1: step 2 is the best (the first of equals), step 4 the newest
        assert ckpt.steps() == [2, 4]
        assert folders(root) == [2, 4]
        assert [v.status for v in ckpt.stats.validations] == ["ok"] * 4


def test_failures_are_reported_never_raised_and_the_checkpoint_is_kept(tmp_path, caplog):
    plan = {1: "raise", 2: "bad", 3: "crash"}
    caplog.set_level(logging.WARNING, logger="mpckpt")
    with mpckpt.Checkpointer(tmp_path, workers=1, keep=mpckpt.KeepBest(1, "val_loss"),
                             validate=functools.partial(misbehave, plan)) as ckpt:
        for step in (1, 2, 3, 4, 5, 6):
            ckpt.save(step, state_of(step))  # training goes on: nothing is raised here
        ckpt.wait()
        runs = {v.step: v for v in ckpt.stats.validations}
        assert [runs[s].status for s in range(1, 7)] == ["failed"] * 3 + ["ok"] * 3
        for step, cause in ((1, "ValueError: no evaluation data for step 1"), (2, "not numbers"),
                            (3, "validator process died")):
            error = runs[step].error
            assert isinstance(error, ValidationError) and error.step == step
            assert f"step {step}: validation failed" in str(error) and cause in str(error)
            assert any(f"step {step}: validation failed" in r.getMessage() and cause in r.getMessage()
                       for r in caplog.records if r.levelno == logging.WARNING)
        assert isinstance(runs[1].error.__cause__, ValueError)
        assert runs[4].pid != runs[3].pid  # the crashed process was replaced for the next one
        # the failed ones are kept; of the validated ones, the best (4) and the newest (6)
        assert ckpt.steps() == [1, 2, 3, 4, 6] and folders(tmp_path) == [1, 2, 3, 4, 6]
        assert "val_loss" not in ckpt.checkpoint(1).metrics
        ckpt.load(1)  # the checkpoint itself is intact
    # opening the root again with validate= validates what has no metrics yet
    with mpckpt.Checkpointer(tmp_path, workers=1, validate=evaluate) as again:
        again.wait()
        assert [(v.step, v.status) for v in again.stats.validations] == [(1, "ok"), (2, "ok"), (3, "ok")]
        assert again.checkpoint(1).metrics["val_loss"] == 3.0


def test_a_validation_past_its_deadline_is_stopped(tmp_path):
    with mpckpt.Checkpointer(tmp_path, workers=1, validate=functools.partial(misbehave, {1: "hang"}),
                             validate_timeout_s=3) as ckpt:
        ckpt.save(1, state_of(1))
        ckpt.save(2, state_of(2))
        ckpt.wait()
        first, second = ckpt.stats.validations
        assert first.status == "failed" and "did not finish within validate_timeout_s=3" in str(first.error)
        assert second.status == "ok" and second.pid != first.pid
        assert ckpt.steps() == [1, 2]


def test_directory_checkpoints_are_validated_and_still_read_back(tmp_path):
    root = tmp_path / "run"
    with mpckpt.Checkpointer(root, workers=1, validate=score_file) as ckpt:
        for step in (1, 2):
            src = tmp_path / f"out{step}"
            src.mkdir()
            (src / "score.txt").write_text(str(step / 10))
            ckpt.report({"loss": 1.0}, checkpoint=Checkpoint.from_directory(src), step=step, mode="sync")
        ckpt.wait()
        assert ckpt.best(1, "score", "max") == [2]
        with ckpt.checkpoint(2).as_directory() as folder:  # validation.json beside it is no stray file
            assert sorted(os.listdir(folder)) == ["score.txt"]


def test_validate_is_refused_where_it_cannot_run(tmp_path):
    with pytest.raises(ConfigError, match="read_only=True with validate"):
        mpckpt.Checkpointer(tmp_path, read_only=True, validate=evaluate)
    with pytest.raises(ConfigError, match="not callable"):
        mpckpt.Checkpointer(tmp_path, validate="evaluate")  # type: ignore[arg-type]
    numbers = (i for i in range(3))
    with pytest.raises(ConfigError, match="picklable by dill"):
        mpckpt.Checkpointer(tmp_path, validate=lambda c: {"n": next(numbers)})
    with pytest.raises(ConfigError, match="validate_timeout_s"):
        mpckpt.Checkpointer(tmp_path, validate=evaluate, validate_timeout_s=0)
    with pytest.raises(ConfigError, match="process of its own"):
        mpckpt.Checkpointer("memory://validate-refused", validate=evaluate)
    assert not any(p.name.startswith("step_") for p in tmp_path.iterdir())


def test_a_damaged_validation_file_leaves_the_checkpoint_unvalidated_and_is_redone(tmp_path, caplog):
    with mpckpt.Checkpointer(tmp_path, workers=1, validate=evaluate) as ckpt:
        ckpt.save(1, state_of(1))
        ckpt.save(2, state_of(2))
    torn = tmp_path / "step_0000000001" / "validation.json"
    torn.write_bytes(torn.read_bytes()[:20])  # as a crash in the middle of its write leaves it
    caplog.set_level(logging.WARNING, logger="mpckpt")
    with mpckpt.Checkpointer(tmp_path, read_only=True) as reader:
        assert reader.steps() == [1, 2]  # never a damaged checkpoint: its manifest and data are intact
        assert "val_loss" not in reader.checkpoint(1).metrics and reader.checkpoint(2).metrics["val_loss"] == 1.0
    assert any("validation metrics of step 1 cannot be read" in r.getMessage() for r in caplog.records)
    with mpckpt.Checkpointer(tmp_path, workers=1, validate=evaluate) as again:
        again.wait()
        assert [v.step for v in again.stats.validations] == [1]
        assert again.checkpoint(1).metrics["val_loss"] == 3.0
    assert json.loads(torn.read_text())["metrics"]["val_loss"] == 3.0


def test_validation_metrics_on_object_stores(remote):  # noqa: F811 -- the fixture
    url, opts = remote  # no rename there: validation.json is a second object beside the manifest
    with mpckpt.Checkpointer(url, storage_options=opts, workers=1, validate=evaluate) as ckpt:
        ckpt.save(1, state_of(1))
        ckpt.save(2, state_of(2))
        ckpt.wait()
        assert [(v.step, v.status) for v in ckpt.stats.validations] == [(1, "ok"), (2, "ok")]
    with mpckpt.Checkpointer(url, storage_options=opts, read_only=True) as reader:
        assert reader.best(1, "val_loss") == [2] and reader.checkpoint(1).metrics["val_loss"] == 3.0
