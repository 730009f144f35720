"""What a new user's first script runs into, said so that it can be acted on.

- ``restore`` logs one INFO line: which step of which absolute root it restored, from where and
  how long it took, or that the root holds no checkpoint and the run starts fresh (a relative
  root run from another folder is otherwise a silent fresh start);
- a checkpoint of another model (a wider layer, a GRU instead of an LSTM) is a ``StateError``
  naming the root, the step and every key path whose shape differs, not torch's bare
  ``RuntimeError``; an optimizer's own refusal names its key and the checkpoint too;
- values that cannot be stored without pickle are named all at once (the first few and how
  many), with the right article, and ``vars(args)`` suggested for an ``argparse.Namespace``.
"""

from __future__ import annotations

import argparse
import collections
import logging
import os

import pytest
import torch

import mpckpt
from mpckpt.errors import StateError


class LanguageModel(torch.nn.Module):
    def __init__(self, rnn: str = "LSTM", hidden: int = 16) -> None:
        super().__init__()
        self.encoder = torch.nn.Embedding(50, 8)
        self.rnn = getattr(torch.nn, rnn)(8, hidden)
        self.decoder = torch.nn.Linear(hidden, 50)


def _saved(root, model: torch.nn.Module) -> None:
    with mpckpt.Checkpointer(root, workers=1) as ckpt:
        ckpt.save(7, {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)}, mode="sync")


def test_restore_says_which_step_of_which_root_or_that_it_starts_fresh(tmp_path, caplog, monkeypatch):
    monkeypatch.chdir(tmp_path)
    caplog.set_level(logging.INFO, logger="mpckpt")
    model = LanguageModel()
    with mpckpt.Checkpointer("runs/exp1", workers=1) as ckpt:  # relative, as a script has it
        assert ckpt.restore({"model": model}) is None
        ckpt.save(3, {"model": model})
    fresh = [r.getMessage() for r in caplog.records if "starting fresh" in r.getMessage()]
    assert fresh == [f"mpckpt: no checkpoint in {tmp_path / 'runs' / 'exp1'}: starting fresh"]
    caplog.clear()
    with mpckpt.Checkpointer("runs/exp1", workers=1, read_only=True) as ckpt:
        assert ckpt.restore({"model": LanguageModel()}) == 3
    said = [r.getMessage() for r in caplog.records if "restored step" in r.getMessage()]
    assert len(said) == 1, said
    assert said[0].startswith(f"mpckpt: restored step 3 of {tmp_path / 'runs' / 'exp1'} from storage (")
    assert said[0].endswith(" s)")
    os.mkdir(tmp_path / "elsewhere")
    monkeypatch.chdir(tmp_path / "elsewhere")  # the same relative root from another folder: said, not silent
    caplog.clear()
    with mpckpt.Checkpointer("runs/exp1", workers=1) as ckpt:
        assert ckpt.restore({"model": LanguageModel()}) is None
    assert any(f"no checkpoint in {tmp_path / 'elsewhere' / 'runs' / 'exp1'}" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("other", [{"hidden": 24}, {"rnn": "GRU"}], ids=["wider", "GRU"])
def test_a_checkpoint_of_another_model_names_root_step_and_keys(tmp_path, other):
    root = tmp_path / "run"
    _saved(root, LanguageModel())
    model = LanguageModel(**other)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with mpckpt.Checkpointer(root, workers=1) as ckpt, pytest.raises(StateError) as info:
        ckpt.restore({"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)})
    message = str(info.value)
    assert f"step 7 of {root}" in message
    assert "'model.rnn.weight_ih_l0'" in message and "in the checkpoint" in message
    assert "Error(s) in loading state_dict" not in message  # torch's own error is not what the user reads
    assert info.value.key.startswith("model.")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # refused before copying


def test_an_optimizer_that_refuses_the_checkpoint_names_its_key_and_the_checkpoint(tmp_path):
    root = tmp_path / "run"
    model = LanguageModel()
    _saved(root, model)
    groups = [{"params": [p]} for p in model.parameters()]  # another number of parameter groups
    with mpckpt.Checkpointer(root, workers=1) as ckpt, pytest.raises(StateError) as info:
        ckpt.restore({"model": LanguageModel(), "optim": torch.optim.SGD(groups, lr=0.1)})
    assert f"step 7 of {root}" in str(info.value)
    assert "state key 'optim'" in str(info.value) and "SGD.load_state_dict refused" in str(info.value)
    assert info.value.key == "optim"
    assert isinstance(info.value.__cause__, StateError) or info.value.__cause__ is not None


def test_every_unstorable_value_is_named_at_once(tmp_path):
    args = argparse.Namespace(lr=20, bptt=35)
    state = {"model": LanguageModel(), "args": args, "log": collections.deque([1.0]),
             "hooks": {"a": lambda: 0, "b": object(), "c": object()}}
    with mpckpt.Checkpointer(tmp_path / "run", workers=1) as ckpt, pytest.raises(StateError) as info:
        ckpt.save(0, state)
    message = str(info.value)
    assert message.startswith("the state holds 5 values that mpckpt cannot store without pickle")
    assert "state key 'args' holds an argparse.Namespace: store vars(args)" in message
    assert "state key 'log' holds a collections.deque" in message
    assert "and 2 more" in message
    assert "a argparse" not in message
    assert info.value.key == "args"
    assert mpckpt.Checkpointer(tmp_path / "run", read_only=True).steps() == []  # nothing was written
    state["args"] = vars(args)  # the suggestion works
    del state["log"], state["hooks"]
    with mpckpt.Checkpointer(tmp_path / "run", workers=1) as ckpt:
        ckpt.save(0, state, mode="sync")
    assert mpckpt.load(tmp_path / "run")["args"] == {"lr": 20, "bptt": 35}


def test_a_file_of_the_users_in_shared_is_never_taken_for_an_orphan(tmp_path):
    """``shared/`` of a folder given as a root may hold someone's files: only names mpckpt writes go."""
    root = tmp_path / "project"
    (root / "shared").mkdir(parents=True)
    (root / "shared" / "notes.txt").write_text("mine")
    (root / "shared" / "step_0000000001.0123456789abcdef01234567.shard-00000.safetensors").write_bytes(b"x")
    with mpckpt.Checkpointer(root, workers=1) as ckpt:  # opening a writer collects orphans
        ckpt.save(0, {"w": torch.ones(4)}, mode="sync")
    assert (root / "shared" / "notes.txt").read_text() == "mine"
    assert not (root / "shared" / "step_0000000001.0123456789abcdef01234567.shard-00000.safetensors").exists()
