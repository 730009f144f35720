"""The Trainer's ``checkpoint-N`` folders that ``MpckptCallback`` writes, with the real Trainer on CPU.

The tiny GPT-2 and data of ``test_transformers.py``. Compared with runs where the Trainer saves
itself:

- the folders appear at the Trainer's steps with the Trainer's files, their contents the
  Trainer's own (weights, optimizer, scheduler, generators, trainer state, arguments, config);
  ``get_last_checkpoint(output_dir)`` finds the newest; ``output_dir`` holds what the Trainer's
  own holds (the default root is beside it, ``<output_dir>.mpckpt``); ``from_pretrained(checkpoint-N)`` gives the weights of step N;
- a run stopped by an exception and resumed in a fresh Trainer with
  ``train(resume_from_checkpoint=True)`` (or the ``checkpoint-N`` path) gives, bit for bit, the
  losses and weights of the Trainer's own resume from its own folders;
- ``save_total_limit`` (with and without the best model) leaves the Trainer's folders, and
  ``best_model_checkpoint`` is the real ``checkpoint-N`` folder that ``load_best_model_at_end`` loads;
- the rotation written out for transformers < 5 (no ``rotate_checkpoints``) keeps what the Trainer's keeps;
- ``trainer_folders=False`` writes none; a folder that cannot be written, or not in
  ``folders_timeout_s``, is an error of ``train()``, and no half folder is left.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import GPT2LMHeadModel, PreTrainedTokenizerFast, TrainingArguments  # noqa: E402
from transformers.trainer_utils import get_last_checkpoint, rotate_checkpoints  # noqa: E402

import mpckpt  # noqa: E402
from mpckpt.errors import ConfigError, MpckptError  # noqa: E402
from mpckpt.integrations._transformers_folder import FolderWriter, rotation  # noqa: E402
from mpckpt.integrations.transformers import MpckptCallback  # noqa: E402

from .test_transformers import (  # noqa: E402
    EVALUATING,
    MAX_STEPS,
    Crash,
    CrashAt,
    hf_folders,
    tokenizer,
    trainer,
    untimed,
    weights,
)


def folder_files(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


def same_tree(a: Any, b: Any, where: str) -> None:
    """Nested dicts / lists / tuples of tensors and plain values, equal bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            same_tree(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same_tree(x, y, f"{where}[{i}]")
    elif hasattr(a, "shape") and hasattr(a, "dtype"):  # numpy arrays of the generators' state
        assert (a == b).all(), where
    else:
        assert a == b, where


def trainer_state(folder: Path) -> dict[str, Any]:
    state = json.loads((folder / "trainer_state.json").read_text())
    state["log_history"] = untimed(state["log_history"])
    best = state.pop("best_model_checkpoint")
    state["best_model_checkpoint"] = None if best is None else Path(best).name
    return state


def test_the_folders_are_the_trainers_own(tmp_path: Path) -> None:
    hf = trainer(tmp_path / "hf", [], processing_class=tokenizer(), **EVALUATING)
    hf.train()
    ours = trainer(tmp_path / "ours", [MpckptCallback(workers=1)], processing_class=tokenizer(), **EVALUATING)
    ours.train()
    out = Path(ours.args.output_dir)
    assert hf_folders(ours) == hf_folders(hf) == [3, 6, 9, 10]
    root = Path(f"{out}.mpckpt")  # the default root, beside the output folder
    with mpckpt.Checkpointer(root, read_only=True) as ckpt:
        assert ckpt.steps() == [3, 6, 9, 10]
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-10")
    # the Trainer's entries only: no root, no staging folder left beside them
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in Path(hf.args.output_dir).iterdir())
    assert ours.state.best_model_checkpoint == str(out / f"checkpoint-{hf.state.best_global_step}")
    for step in (3, 6, 9, 10):
        theirs, mine = Path(hf.args.output_dir) / f"checkpoint-{step}", out / f"checkpoint-{step}"
        assert folder_files(mine) == folder_files(theirs), step
        for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
            same_tree(torch.load(mine / name, weights_only=False), torch.load(theirs / name, weights_only=False),
                      f"{step}/{name}")
        for name in ("config.json", "generation_config.json"):
            assert json.loads((mine / name).read_text()) == json.loads((theirs / name).read_text()), name
        assert trainer_state(mine) == trainer_state(theirs), step
        args = torch.load(mine / "training_args.bin", weights_only=False)
        assert isinstance(args, TrainingArguments)
        assert {**args.to_dict(), "output_dir": hf.args.output_dir} == hf.args.to_dict()
        loaded = GPT2LMHeadModel.from_pretrained(mine).state_dict()
        for name, tensor in GPT2LMHeadModel.from_pretrained(theirs).state_dict().items():
            assert torch.equal(loaded[name], tensor), f"{step}: {name}"
        for name, tensor in mpckpt.load(root, step)["model"].items():
            assert torch.equal(loaded[name], tensor), f"{step}: {name}"


@pytest.mark.parametrize("crash_after", [5, 7])  # resumed from step 3 (mid-epoch) / 6 (the epoch's end)
def test_a_resume_from_the_folders_is_the_trainers_own_resume(tmp_path: Path, crash_after: int) -> None:
    saved = (crash_after // 3) * 3

    def resumed(out: Path, callbacks: list[Any]) -> Any:
        first = trainer(out, [*callbacks, CrashAt(crash_after)], **EVALUATING)
        with pytest.raises(Crash):
            first.train()
        for cb in callbacks:
            cb.close()  # what the Checkpointer's finalizer does at exit: pending saves and folders are written
        assert hf_folders(first) == [s for s in (3, 6) if s <= saved]
        second = trainer(out, [MpckptCallback(workers=1)] if callbacks else [], **EVALUATING)
        # True: the newest folder (get_last_checkpoint); or the folder's path, as a user writes either
        second.train(resume_from_checkpoint=True if crash_after == 7 else str(out / "hf" / f"checkpoint-{saved}"))
        return second

    theirs = resumed(tmp_path / "hf", [])
    ours = resumed(tmp_path / "ours", [MpckptCallback(workers=1)])
    assert sorted(ours.losses) == sorted(theirs.losses) == list(range(saved + 1, MAX_STEPS + 1))
    for step, loss in theirs.losses.items():
        assert torch.equal(ours.losses[step], loss), f"loss of step {step} differs from the Trainer's own resume"
    a, b = weights(theirs), weights(ours)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    x, y = dataclasses.asdict(theirs.state), dataclasses.asdict(ours.state)
    assert untimed(x.pop("log_history"), "train_loss") == untimed(y.pop("log_history"), "train_loss")
    assert Path(x.pop("best_model_checkpoint")).name == Path(y.pop("best_model_checkpoint")).name
    assert x == y
    assert hf_folders(ours) == hf_folders(theirs) == [3, 6, 9, 10]


@pytest.mark.parametrize("case", ["limit 2", "limit 1, best at end"])
def test_rotation_and_the_best_folder_are_the_trainers(tmp_path: Path, case: str) -> None:
    extra: dict[str, Any] = dict(save_steps=2, save_total_limit=2)
    if case != "limit 2":
        extra.update(eval_strategy="steps", eval_steps=2, save_total_limit=1, load_best_model_at_end=True,
                     metric_for_best_model="eval_loss", learning_rate=3e-2)  # the best is not the last step
    hf = trainer(tmp_path / "hf", [], **extra)
    hf.train()
    ours = trainer(tmp_path / "ours", [MpckptCallback(workers=1)], **extra)
    ours.train()
    expected = hf_folders(hf)
    assert hf_folders(ours) == expected == ([8, 10] if case == "limit 2" else [hf.state.best_global_step])
    if case == "limit 2":
        assert ours.state.best_model_checkpoint is None
        return
    best = hf.state.best_global_step
    assert best is not None and best != MAX_STEPS, "the test needs a best step before the last one"
    assert ours.state.best_global_step == best
    assert ours.state.best_model_checkpoint == str(Path(ours.args.output_dir) / f"checkpoint-{best}")
    a, b = weights(hf), weights(ours)  # load_best_model_at_end loaded the same weights from the folder
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert not (Path(ours.args.output_dir) / "mpckpt-best").exists()


def test_trainer_folders_false_writes_none(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    t = trainer(tmp_path, [MpckptCallback(root, workers=1, trainer_folders=False)], **EVALUATING)
    t.train()
    assert hf_folders(t) == []
    assert get_last_checkpoint(t.args.output_dir) is None
    assert mpckpt.Checkpointer(root, read_only=True).steps() == [3, 6, 9, 10]
    best = t.state.best_model_checkpoint  # the best model's folder of trainer_folders=False instead
    assert best == str(Path(t.args.output_dir) / "mpckpt-best" / f"checkpoint-{t.state.best_global_step}")
    assert not (Path(best) / "optimizer.pt").exists()


class FailingTokenizer(PreTrainedTokenizerFast):  # type: ignore[misc]
    """A real tokenizer whose files cannot be saved (as on a full disk), or only once ``release`` is set."""

    release: threading.Event | None = None

    def save_pretrained(self, *args: Any, **kwargs: Any) -> Any:
        if self.release is None:
            raise OSError(28, "No space left on device")
        self.release.wait()
        return super().save_pretrained(*args, **kwargs)


def failing_tokenizer(release: threading.Event | None) -> FailingTokenizer:
    t = tokenizer()
    failing = FailingTokenizer(tokenizer_object=t._tokenizer, pad_token="t0", unk_token="t1")
    failing.release = release
    return failing


def test_a_folder_that_cannot_be_written_is_raised_by_train(tmp_path: Path) -> None:
    t = trainer(tmp_path, [MpckptCallback(workers=1)], processing_class=failing_tokenizer(None), max_steps=6)
    with pytest.raises(MpckptError, match=r"could not write the Trainer's folder .*checkpoint-3.*No space left") as raised:
        t.train()
    assert isinstance(raised.value.__cause__, OSError)  # the writer's own error, attached
    out = Path(t.args.output_dir)
    assert not out.exists() or sorted(p.name for p in out.iterdir()) == []  # no folder, not even half of one
    assert mpckpt.Checkpointer(f"{out}.mpckpt", read_only=True).steps() == [3, 6]  # the checkpoints are committed


def test_folders_not_written_in_time_are_an_error_of_train(tmp_path: Path) -> None:
    release = threading.Event()
    callback = MpckptCallback(workers=1, folders_timeout_s=0.2)
    t = trainer(tmp_path, [callback], processing_class=failing_tokenizer(release), max_steps=6)
    try:
        with pytest.raises(MpckptError, match=r"steps \[3, 6\] .*not written within folders_timeout_s=0.2"):
            t.train()
    finally:
        release.set()  # the writer goes on, and ends with the process: not waited for by close()
    assert mpckpt.Checkpointer(f"{t.args.output_dir}.mpckpt", read_only=True).steps() == [3, 6]


def test_best_model_dir_needs_trainer_folders_off(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="trainer_folders=False"):
        MpckptCallback(tmp_path, best_model_dir=tmp_path / "best")
    with pytest.raises(ConfigError, match="folders_timeout_s"):
        MpckptCallback(tmp_path, folders_timeout_s=0)


@pytest.mark.parametrize(("limit", "best"), [(2, None), (2, 3), (1, 3), (1, None), (3, 5), (1, 5)])
def test_the_rotation_for_older_transformers_keeps_what_the_trainers_keeps(
        tmp_path: Path, limit: int, best: int | None) -> None:
    kept = {}
    for which, own in (("trainer", rotate_checkpoints), ("written out", None)):
        out = tmp_path / which
        for step in (2, 4, 6, 8, 10):
            (out / f"checkpoint-{step}").mkdir(parents=True)
        writer = FolderWriter(str(out), training=True)
        writer.protect = None if best is None else str(out / f"checkpoint-{best * 2}")
        rotation(str(out), limit, writer, own)(str(out / "checkpoint-10"))
        kept[which] = sorted(p.name for p in out.iterdir())
    assert kept["written out"] == kept["trainer"]
    assert len(kept["trainer"]) == max(limit, 1 if best is None or best == 5 else 2)
