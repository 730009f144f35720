"""MpckptCallback and resume_path with the real Hugging Face Trainer on CPU.

A tiny GPT-2 (from a config, dropout on) trains on a small in-memory dataset, shuffled, over
two epochs (6 optimizer steps an epoch):

Most of these run with ``trainer_folders=False`` (the root only, as before the callback wrote the
Trainer's folders); the folders themselves are ``test_transformers_folders.py``'s.

- A run stopped by an exception after step 5 (or 7) and resumed with
  ``resume_from_checkpoint=resume_path(root)`` from the checkpoint of step 3 (mid-epoch) or 6
  (the epoch's end) gives, bit for bit, the per-step losses and the final weights of the
  uninterrupted run (an evaluation at every save draws from the generators after the Trainer's
  save point: a snapshot taken before it fails this); the Trainer never wrote a folder of its
  own. The same check fails when the resume loses the generators' state.
- The steps saved are the Trainer's own for ``save_strategy`` "epoch" and "best" (compared with
  a run where the Trainer saves itself; "steps": every 3rd and the last, above).
- ``save_total_limit`` keeps the newest N; with ``load_best_model_at_end`` the best is kept too,
  and the model at the end is the one the Trainer itself ends with (same weights, same best step).
- ``EarlyStoppingCallback`` stops at the Trainer's own step, and the saved trainer state (its
  patience counter, the best step and metric, the log history) is what the Trainer writes.
- ``save_only_model=True`` saves the model and the trainer state only, as the Trainer does.
- ``resume_path`` of an empty root is None; of a root of another kind, a clear error.
- The resumed run's ``TrainerState`` is the uninterrupted run's (the callbacks' states as the
  Trainer records them at its saves; ``best_model_checkpoint`` the same folder, written again
  when the resume finds it gone).
- ``best_model_checkpoint`` is a folder of the best step that ``from_pretrained`` reads, where
  the Trainer's own is ``checkpoint-N``; the Trainer's ``load_best_model_at_end`` loads it.
- With the Trainer's folders (the default) they are written at the Trainer's own steps and
  rotated as ``save_total_limit`` says.
- ``resume_path`` folders have the Trainer's ``config.json``, ``generation_config.json`` and
  ``training_args.bin``.
- A fresh ``train()`` into a root that holds a run is a ``StepOrderError`` before its first step,
  the root untouched; a resume from an older step moves the newer checkpoints aside, whole
  (``superseded.step_*``), and saves on from its step; with ``discard_newer=True`` the newer
  checkpoints are deleted instead.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import transformers  # noqa: E402
from transformers import (  # noqa: E402
    EarlyStoppingCallback,
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

import mpckpt  # noqa: E402
from mpckpt.errors import MpckptError, StateError, StepOrderError  # noqa: E402
from mpckpt.integrations.transformers import MpckptCallback, resume_path  # noqa: E402

transformers.logging.set_verbosity_error()

VOCAB, SEQ, N_TRAIN, BATCH = 64, 16, 24, 4  # 6 optimizer steps an epoch
MAX_STEPS = 10


def dataset(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


class Recording(Trainer):  # type: ignore[misc]
    """Keeps every training step's loss tensor, by global step (1-based)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.losses: dict[int, torch.Tensor] = {}

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.losses[self.state.global_step + 1] = loss.detach().clone()
        return loss


class Crash(Exception):
    pass


class CrashAt(TrainerCallback):  # type: ignore[misc]
    """Stops the run the hard way (an exception) before the step after ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            raise Crash(f"stopped after step {self.step}")


def trainer(tmp: Path, callbacks: list[Any], *, processing_class: Any = None, **overrides: Any) -> Recording:
    transformers.set_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    settings: dict[str, Any] = dict(output_dir=str(tmp / "hf"), max_steps=MAX_STEPS, per_device_train_batch_size=BATCH,
                                    per_device_eval_batch_size=BATCH, learning_rate=1e-3, warmup_steps=2,
                                    save_strategy="steps", save_steps=3, logging_steps=1, report_to=[], use_cpu=True,
                                    seed=0, disable_tqdm=True, dataloader_num_workers=0)
    settings.update(overrides)
    evaluating = settings.get("eval_strategy", "no") != "no"
    return Recording(model=model, args=TrainingArguments(**settings), train_dataset=dataset(N_TRAIN, 1),
                     eval_dataset=dataset(8, 2) if evaluating else None, callbacks=callbacks,
                     processing_class=processing_class)


def tokenizer() -> Any:
    """A word-level tokenizer over the vocabulary, built here (nothing is downloaded)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t1")),
                                   pad_token="t0", unk_token="t1")


def weights(t: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in t.model.state_dict().items()}


def hf_folders(t: Trainer) -> list[int]:
    out = Path(t.args.output_dir)
    return sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*")) if out.exists() else []


# evaluating at each save draws from the generators after the Trainer's save point: the snapshot must too;
# the best step is tracked (best_model_checkpoint)
EVALUATING = {"eval_strategy": "steps", "eval_steps": 3, "metric_for_best_model": "eval_loss"}


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> Recording:
    """The uninterrupted run (saving through the callback too)."""
    tmp = tmp_path_factory.mktemp("whole")
    run = trainer(tmp, [MpckptCallback(tmp / "ckpt", workers=1, trainer_folders=False)], **EVALUATING)
    run.train()
    assert sorted(run.losses) == list(range(1, MAX_STEPS + 1))
    return run


@pytest.mark.parametrize("crash_after", [5, 7])  # resumed from step 3 (mid-epoch) / step 6 (the epoch's end)
def test_stopped_and_resumed_run_is_bit_identical(tmp_path: Path, whole: Recording, crash_after: int) -> None:
    evaluating = EVALUATING

    root = tmp_path / "b" / "ckpt"
    assert resume_path(root) is None  # nothing saved yet: the same line starts a fresh run
    callback = MpckptCallback(root, workers=1, trainer_folders=False)
    first = trainer(tmp_path / "b", [callback, CrashAt(crash_after)], **evaluating)
    with pytest.raises(Crash):
        first.train(resume_from_checkpoint=resume_path(root))
    callback.close()  # what the Checkpointer's finalizer does at exit: pending saves are committed
    saved = (crash_after // 3) * 3
    assert mpckpt.Checkpointer(root, read_only=True).latest_step == saved
    assert hf_folders(first) == []  # the Trainer's own synchronous save never ran (and no folder was asked for)

    path = resume_path(root)
    assert path is not None and Path(path).name == f"checkpoint-{saved}"
    if crash_after == 7:  # resumed on another machine: the best step's folder is not there
        shutil.rmtree(Path(first.args.output_dir) / "mpckpt-best")
    second = trainer(tmp_path / "b", [MpckptCallback(root, workers=1, trainer_folders=False)], **evaluating)
    second.train(resume_from_checkpoint=path)

    assert sorted(second.losses) == list(range(saved + 1, MAX_STEPS + 1))
    for step, loss in second.losses.items():
        assert torch.equal(loss, whole.losses[step]), f"loss of step {step} differs after the resume"
    for step in range(saved + 1, crash_after + 1):  # the steps run twice gave the same losses both times
        assert torch.equal(first.losses[step], whole.losses[step])
    a, b = weights(whole), weights(second)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert second.state.global_step == whole.state.global_step == MAX_STEPS
    assert_same_trainer_state(whole, second)
    with mpckpt.Checkpointer(root, read_only=True) as ckpt:
        assert ckpt.steps() == [3, 6, 9, 10]
        final = ckpt.load()
    assert set(final) == {"format", "model", "optimizer", "scheduler", "rng", "trainer_state", "config",
                          "generation_config", "training_args"}
    for name in a:
        assert torch.equal(final["model"][name], a[name]), name


def assert_same_trainer_state(whole: Trainer, resumed: Trainer) -> None:
    """As the Trainer's own resume tests compare them: everything but the timings of the log."""
    a, b = dataclasses.asdict(whole.state), dataclasses.asdict(resumed.state)
    # the summary's train_loss is over the steps of that train() call only
    assert untimed(a.pop("log_history"), "train_loss") == untimed(b.pop("log_history"), "train_loss")
    best_a, best_b = a.pop("best_model_checkpoint"), b.pop("best_model_checkpoint")
    assert a == b
    assert whole.state.best_global_step is not None
    assert best_a is not None and best_b is not None  # the same folder under each run's output_dir
    assert Path(best_a).relative_to(whole.args.output_dir) == Path(best_b).relative_to(resumed.args.output_dir)
    assert Path(best_b).name == f"checkpoint-{resumed.state.best_global_step}"
    assert (Path(best_b) / "model.safetensors").is_file()


def test_the_resume_would_differ_without_the_rng_state(tmp_path: Path, whole: Recording) -> None:
    """The check above can fail: a resume that drops the generators' state draws other dropout masks."""
    root = tmp_path / "ckpt"
    callback = MpckptCallback(root, workers=1)
    first = trainer(tmp_path / "b", [callback, CrashAt(4)], **EVALUATING)
    with pytest.raises(Crash):
        first.train()
    callback.close()
    path = resume_path(root)
    assert path is not None
    (Path(path) / "rng_state.pth").unlink()
    torch.manual_seed(1234)
    second = trainer(tmp_path / "b", [], **EVALUATING)
    torch.manual_seed(1234)  # the Trainer seeds at init; a process that lost the generators' state starts elsewhere
    second.train(resume_from_checkpoint=path)
    assert not torch.equal(second.losses[4], whole.losses[4])


@pytest.mark.parametrize("strategy", ["epoch", "best"])  # "steps": [3, 6, 9, 10] in the test above
def test_saves_at_the_trainers_own_steps(tmp_path: Path, strategy: str) -> None:
    extra: dict[str, Any] = {"save_strategy": strategy}
    if strategy == "best":
        extra.update(eval_strategy="steps", eval_steps=2, metric_for_best_model="eval_loss")
    hf = trainer(tmp_path / "hf", [], **extra)
    hf.train()
    expected = hf_folders(hf)
    assert expected, "the Trainer itself saved nothing: the comparison would be empty"
    root = tmp_path / "ckpt"
    ours = trainer(tmp_path / "ours", [MpckptCallback(root, workers=1)], **extra)
    ours.train()
    assert hf_folders(ours) == expected  # the Trainer's folders, written from the committed steps
    with mpckpt.Checkpointer(root, read_only=True) as ckpt:
        assert ckpt.steps() == expected
    assert ours.state.best_global_step == hf.state.best_global_step
    assert ours.state.best_metric == hf.state.best_metric
    # resume_path's folder has what the Trainer writes beside the weights, as it writes it
    theirs = Path(hf.args.output_dir) / f"checkpoint-{expected[-1]}"
    path = resume_path(root, expected[-1], directory=tmp_path / "resume")
    assert path is not None
    for name in ("config.json", "generation_config.json"):
        assert json.loads((Path(path) / name).read_text()) == json.loads((theirs / name).read_text()), name
    args = torch.load(Path(path) / "training_args.bin", weights_only=False)
    assert isinstance(args, TrainingArguments) and args.output_dir == ours.args.output_dir
    assert hf.args.to_dict() == {**args.to_dict(), "output_dir": hf.args.output_dir}
    loaded = GPT2LMHeadModel.from_pretrained(path)
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, mpckpt.load(root, expected[-1])["model"][name]), name


def test_save_total_limit_keeps_the_newest(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    t = trainer(tmp_path, [MpckptCallback(root, workers=1)], save_steps=2, save_total_limit=2)
    t.train()
    with mpckpt.Checkpointer(root, read_only=True) as ckpt:
        assert ckpt.steps() == [8, 10]
        assert ckpt.best(1, "epoch", "max") == [10]
    assert hf_folders(t) == [8, 10]  # the Trainer's rotation of its folders


def test_a_retention_group_wins_over_save_total_limit_as_keep_last_does(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    # trainer_folders=False: no folder being written holds a checkpoint that retention would delete
    callback = MpckptCallback(root, trainer_folders=False, uploads=mpckpt.Uploads(workers=1),
                              retention=mpckpt.Retention(keep_last=1))
    trainer(tmp_path, [callback], save_steps=2, save_total_limit=3).train()
    with mpckpt.Checkpointer(root, read_only=True) as ckpt:
        assert ckpt.steps() == [MAX_STEPS]  # its own, not also the Trainer's three


def test_load_best_model_at_end_matches_the_trainer(tmp_path: Path) -> None:
    extra: dict[str, Any] = dict(eval_strategy="steps", eval_steps=2, save_steps=2, save_total_limit=1,
                                 load_best_model_at_end=True, metric_for_best_model="eval_loss",
                                 learning_rate=3e-2)  # high enough that the last step is not the best one
    hf = trainer(tmp_path / "hf", [], processing_class=tokenizer(), **extra)
    hf.train()
    root = tmp_path / "ckpt"
    ours = trainer(tmp_path / "ours", [MpckptCallback(root, workers=1, trainer_folders=False)],
                   processing_class=tokenizer(), **extra)
    ours.train()
    best = hf.state.best_global_step
    assert best is not None and best != MAX_STEPS, "the test needs a best step before the last one"
    assert ours.state.best_global_step == best
    a, b = weights(hf), weights(ours)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    with mpckpt.Checkpointer(root, read_only=True) as ckpt:
        assert ckpt.steps() == [best, MAX_STEPS]  # the newest and the best, as the Trainer's rotation keeps
        assert ckpt.checkpoint(best).metrics["eval_loss"] == hf.state.best_metric
    # best_model_checkpoint: the best step's folder, as the Trainer's (there: output_dir/checkpoint-N)
    assert hf.state.best_model_checkpoint == str(Path(hf.args.output_dir) / f"checkpoint-{best}")
    path = ours.state.best_model_checkpoint
    assert path == str(Path(ours.args.output_dir) / "mpckpt-best" / f"checkpoint-{best}")
    assert sorted(p.name for p in Path(path).parent.iterdir()) == [f"checkpoint-{best}"]  # the best one only
    # the Trainer's folder but the optimizer, scheduler and generators (those resume through resume_path)
    theirs = {p.name for p in Path(hf.state.best_model_checkpoint).iterdir()}
    assert {"tokenizer.json", "config.json", "training_args.bin"} <= theirs
    assert {p.name for p in Path(path).iterdir()} == theirs - {"optimizer.pt", "scheduler.pt", "rng_state.pth"}
    loaded = GPT2LMHeadModel.from_pretrained(path)
    for name, tensor in GPT2LMHeadModel.from_pretrained(hf.state.best_model_checkpoint).state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    saved = json.loads(mpckpt.load(root, MAX_STEPS)["trainer_state"])
    assert saved["best_model_checkpoint"] == path  # in the checkpoint's trainer_state.json too, as the Trainer's


def test_a_best_folder_that_cannot_be_written_is_raised_by_train(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a folder")
    root = tmp_path / "ckpt"
    extra: dict[str, Any] = dict(eval_strategy="steps", eval_steps=3, metric_for_best_model="eval_loss")
    t = trainer(tmp_path, [MpckptCallback(root, workers=1, trainer_folders=False,
                                          best_model_dir=tmp_path / "file" / "best")], **extra)
    with pytest.raises(MpckptError, match="could not write the best checkpoint's folder"):
        t.train()
    assert mpckpt.Checkpointer(root, read_only=True).steps() == [3, 6, 9, 10]  # the checkpoints are committed


def test_best_model_dir_false_leaves_best_model_checkpoint_none(tmp_path: Path) -> None:
    """Without the folder, load_best_model_at_end still ends with the best weights (read from mpckpt)."""
    extra: dict[str, Any] = dict(eval_strategy="steps", eval_steps=2, save_steps=2, load_best_model_at_end=True,
                                 metric_for_best_model="eval_loss", learning_rate=3e-2)
    root = tmp_path / "ckpt"
    ours = trainer(tmp_path / "ours", [MpckptCallback(root, workers=1, trainer_folders=False, best_model_dir=False)],
                   **extra)
    ours.train()
    best = ours.state.best_global_step
    assert best is not None and best != MAX_STEPS
    assert ours.state.best_model_checkpoint is None
    assert not (Path(ours.args.output_dir) / "mpckpt-best").exists()
    for name, tensor in mpckpt.load(root, best)["model"].items():
        assert torch.equal(weights(ours)[name], tensor), name


def test_resume_path_refuses_other_checkpoints(tmp_path: Path) -> None:
    with mpckpt.Checkpointer(tmp_path, workers=1) as ckpt:
        ckpt.save(1, {"w": torch.ones(2)})
    with pytest.raises(StateError, match="not saved by MpckptCallback"):
        resume_path(tmp_path)


def test_early_stopping_state_is_the_trainers(tmp_path: Path) -> None:
    """Early stopping counts as with the Trainer's own saves, and its state is in the checkpoint."""
    extra: dict[str, Any] = dict(eval_strategy="steps", eval_steps=2, save_steps=2, load_best_model_at_end=True,
                                 metric_for_best_model="eval_loss", learning_rate=3e-2)
    hf = trainer(tmp_path / "hf", [EarlyStoppingCallback(early_stopping_patience=2)], **extra)
    hf.train()
    root = tmp_path / "ckpt"
    ours = trainer(tmp_path / "ours", [MpckptCallback(root, workers=1), EarlyStoppingCallback(early_stopping_patience=2)],
                   **extra)
    ours.train()
    assert ours.state.global_step == hf.state.global_step
    last = hf.state.global_step
    with open(Path(hf.args.output_dir) / f"checkpoint-{last}" / "trainer_state.json") as f:
        theirs = json.load(f)
    saved = json.loads(mpckpt.load(root, last)["trainer_state"])
    assert saved["stateful_callbacks"] == theirs["stateful_callbacks"]  # early stopping's and TrainerControl's
    assert theirs["stateful_callbacks"]["EarlyStoppingCallback"]["attributes"]["early_stopping_patience_counter"] > 0
    for key in ("global_step", "best_global_step", "best_metric", "epoch", "max_steps", "train_batch_size"):
        assert saved[key] == theirs[key], key
    assert untimed(saved["log_history"]) == untimed(theirs["log_history"])


def untimed(history: list[dict[str, Any]], *also: str) -> list[dict[str, Any]]:
    """Log entries without the wall-clock figures (they differ from run to run), nor the keys ``also``."""
    return [{k: v for k, v in e.items() if "runtime" not in k and "per_second" not in k and k not in also}
            for e in history]


def test_save_only_model(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    t = trainer(tmp_path, [MpckptCallback(root, workers=1)], max_steps=3, save_only_model=True)
    t.train()
    state = mpckpt.load(root)
    assert set(state) == {"format", "model", "trainer_state", "config", "generation_config", "training_args"}
    path = resume_path(root, directory=tmp_path / "resume")
    assert path is not None
    assert sorted(p.name for p in Path(path).iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "trainer_state.json", "training_args.bin"]
    for name, tensor in weights(t).items():
        assert torch.equal(state["model"][name], tensor), name


def test_a_fresh_run_into_a_used_root_is_refused_or_discards(tmp_path: Path) -> None:
    """A second, fresh train() into a root that holds a run: nothing trains and nothing is lost;
    with discard_newer=True the old run's checkpoints go and the new run's are saved."""
    root = tmp_path / "ckpt"
    first = trainer(tmp_path / "a", [MpckptCallback(root, workers=1)], max_steps=6)
    first.train()
    second = trainer(tmp_path / "b", [MpckptCallback(root, workers=1)], max_steps=6, learning_rate=5e-3)
    with pytest.raises(StepOrderError) as raised:
        second.train()
    message = str(raised.value)
    for part in (str(root), "up to step 6", "a fresh run", "resume_path(root)", "discard_newer=True", "a new root"):
        assert part in message, part
    assert second.losses == {}  # refused before the first step
    with mpckpt.Checkpointer(root, read_only=True) as ckpt:
        assert ckpt.steps() == [3, 6]
        kept = ckpt.load(6)["model"]
    for name, tensor in weights(first).items():
        assert torch.equal(kept[name], tensor), name

    third = trainer(tmp_path / "b", [MpckptCallback(root, workers=1, discard_newer=True)], max_steps=6,
                    learning_rate=5e-3)
    third.train()
    with mpckpt.Checkpointer(root, read_only=True) as ckpt:
        assert ckpt.steps() == [3, 6]
        new = ckpt.load(6)["model"]
    assert any(not torch.equal(new[n], t) for n, t in weights(first).items())
    for name, tensor in weights(third).items():
        assert torch.equal(new[name], tensor), name


def test_a_resume_from_an_older_step_sets_the_newer_aside_or_discards_them(tmp_path: Path) -> None:
    """resume_path(root, step=3) of a root that holds steps 3..10: the newer ones are moved aside,
    whole (kept, no longer checkpoints), and the resumed run (other settings) saves its own; with
    discard_newer=True the steps after 3 are deleted instead."""
    root = tmp_path / "ckpt"
    first = trainer(tmp_path / "a", [MpckptCallback(root, workers=1)])
    first.train()
    path = resume_path(root, 3)
    assert path is not None
    changed = dict(max_grad_norm=1e-3)  # (the learning rate would come back with the optimizer and scheduler)
    before = {s: mpckpt.load(root, s)["model"] for s in (6, 9, 10)}
    second = trainer(tmp_path / "b", [MpckptCallback(root, workers=1)], **changed)
    second.train(resume_from_checkpoint=path)
    assert sorted(second.losses) == list(range(4, MAX_STEPS + 1))
    aside = sorted(p.name for p in root.iterdir() if p.name.startswith("superseded."))
    assert [name.split(".")[1] for name in aside] == ["step_0000000006", "step_0000000009", "step_0000000010"]
    for name in aside:  # whole: the manifest and the shards, as they were
        step = int(name.split(".")[1][len("step_"):])
        moved = tmp_path / "moved" / f"step_{step:010d}"
        shutil.copytree(root / name, moved)
        for key, tensor in mpckpt.load(moved)["model"].items():
            assert torch.equal(tensor, before[step][key]), (name, key)
    with mpckpt.Checkpointer(root, read_only=True) as ckpt:
        assert ckpt.steps() == [3, 6, 9, 10]
        resumed = ckpt.load(10)["model"]
    for name, tensor in weights(second).items():
        assert torch.equal(resumed[name], tensor), name
    assert any(not torch.equal(resumed[n], t) for n, t in weights(first).items())
    shutil.rmtree(root)  # the first run again, for the discard_newer case
    first = trainer(tmp_path / "a2", [MpckptCallback(root, workers=1)])
    first.train()
    path = resume_path(root, 3)

    third = trainer(tmp_path / "b", [MpckptCallback(root, workers=1, discard_newer=True)], **changed)
    third.train(resume_from_checkpoint=path)
    assert sorted(third.losses) == list(range(4, MAX_STEPS + 1))
    with mpckpt.Checkpointer(root, read_only=True) as ckpt:
        assert ckpt.steps() == [3, 6, 9, 10]
        last = ckpt.load(10)["model"]
    for name, tensor in weights(third).items():
        assert torch.equal(last[name], tensor), name
    assert any(not torch.equal(last[n], t) for n, t in weights(first).items())
