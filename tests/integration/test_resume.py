"""Exact resume, retention policies and save triggers, through a real Checkpointer on local disk.

- ``mpckpt.RNGState()`` saved with the state puts torch's, Python's and NumPy's generators back
  at ``restore``: the numbers drawn after a restore are the ones drawn after the save; it
  refuses a value that is not an RNGState's with a ``StateError``.
- ``keep=`` takes retention policies combined with ``|``, and with ``keep_last`` either one
  keeps a checkpoint; anything else is a ``ConfigError`` naming ``keep``.
- ``trigger=``: ``save`` saves only the steps that are due (else returns None, copying nothing),
  ``should_save`` says the same, ``force=True`` saves regardless; a bad trigger names ``trigger``.
"""

from __future__ import annotations

import logging
import random
import time

import numpy
import pytest
import torch

import mpckpt
from mpckpt.errors import ConfigError, StateError
from tests.waiting import wait_until


def _draw() -> tuple[list[float], float, list[float]]:
    return torch.rand(5).tolist(), random.random(), numpy.random.rand(5).tolist()


def test_rng_state_restores_every_generator(tmp_path):
    torch.manual_seed(1)
    random.seed(2)
    numpy.random.seed(3)
    _draw()  # move every generator off its seed
    rng = mpckpt.RNGState()
    with mpckpt.Checkpointer(tmp_path / "run", workers=1) as ckpt:
        ckpt.save(10, {"rng": rng, "step": 10}, mode="sync")
        after_save = _draw()
        _draw()  # training goes on, then the process dies
    torch.manual_seed(99)
    random.seed(99)
    numpy.random.seed(99)
    with mpckpt.Checkpointer(tmp_path / "run", workers=1) as ckpt:
        state = {"rng": mpckpt.RNGState(), "step": 0}
        assert ckpt.restore(state) == 10
    assert state["step"] == 10
    assert _draw() == after_save  # bit-identical: the same numbers as right after the save


def test_rng_state_is_stored_without_pickle_and_refuses_what_is_not_one(tmp_path):
    with mpckpt.Checkpointer(tmp_path / "run", workers=1) as ckpt:  # allow_pickle is off
        ckpt.save(0, {"rng": mpckpt.RNGState()}, mode="sync")
        loaded = ckpt.load()["rng"]
        assert set(loaded) >= {"torch", "python", "numpy"}
        assert isinstance(loaded["torch"], torch.Tensor) and loaded["python"]["internal"].numel() == 625
        ckpt.save(1, {"rng": {"lr": 0.1}}, mode="sync")
        with pytest.raises(StateError, match="does not hold an RNGState"):
            ckpt.restore({"rng": mpckpt.RNGState()})


def test_keep_policies_combine_and_keep_last_joins_them(tmp_path):
    losses = {0: 0.9, 1: 0.1, 2: 0.8, 3: 0.7, 4: 0.6, 5: 0.5, 6: 0.4}
    keep = mpckpt.KeepLast(2) | mpckpt.KeepBest(1, "loss")
    with mpckpt.Checkpointer(tmp_path / "a", workers=1, keep=keep) as ckpt:
        for step, loss in losses.items():
            ckpt.save(step, {"x": torch.ones(4) * step}, metrics={"loss": loss}, mode="sync")
        ckpt.wait()
        assert ckpt.steps() == [1, 5, 6]  # the best (loss 0.1) and the last two
    assert sorted(p.name for p in (tmp_path / "a").glob("step_*")) == [
        "step_0000000001", "step_0000000005", "step_0000000006"]
    with mpckpt.Checkpointer(tmp_path / "b", workers=1, keep=mpckpt.KeepEvery(3), keep_last=1) as ckpt:
        for step in range(8):
            ckpt.save(step, {"x": torch.ones(4)}, mode="sync")
        ckpt.wait()
        assert ckpt.steps() == [0, 3, 6, 7]  # multiples of 3, and the newest
    for bad in (3, "KeepLast(3)", [mpckpt.KeepLast(1)]):
        with pytest.raises(ConfigError, match="keep="):
            mpckpt.Checkpointer(tmp_path / "c", workers=1, keep=bad)


def test_a_trigger_decides_which_saves_save(tmp_path):
    trigger = mpckpt.EveryNSteps(3) | mpckpt.EveryNSeconds(3600)
    with mpckpt.Checkpointer(tmp_path / "run", workers=1, trigger=trigger) as ckpt:
        answers, futures = [], {}
        for step in range(8):
            answers.append(ckpt.should_save(step))
            futures[step] = ckpt.save(step, {"x": torch.ones(4) * step})
        assert answers == [step % 3 == 0 for step in range(8)]
        assert [s for s, f in futures.items() if f is not None] == [0, 3, 6]
        forced = ckpt.save(8, {"x": torch.ones(4) * 8}, force=True)
        assert forced is not None and forced.result(60).name == "step_0000000008"
        with pytest.raises(mpckpt.errors.StepOrderError):
            ckpt.save(7, {"x": torch.ones(4)})  # a step that is not due is still checked
        ckpt.wait()
        assert ckpt.steps() == [0, 3, 6, 8]
    with mpckpt.Checkpointer(tmp_path / "seconds", workers=1, trigger=mpckpt.EveryNSeconds(0.05)) as ckpt:
        time.sleep(0.1)  # time passing is the scenario (a time trigger): 0.05 s after the open, due
        assert ckpt.should_save(1) and ckpt.save(1, {"x": torch.ones(1)}) is not None
    for bad in (5, "EveryNSteps(5)", mpckpt.KeepLast(1)):
        with pytest.raises(ConfigError, match="trigger="):
            mpckpt.Checkpointer(tmp_path / "bad", workers=1, trigger=bad)


def test_every_commit_logs_one_info_line(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="mpckpt"), mpckpt.Checkpointer(tmp_path / "run", workers=1) as ckpt:
        ckpt.save(3, {"x": torch.ones(1 << 18)}, mode="sync")  # 1 MiB
        ckpt.save(4, {"x": torch.ones(1 << 18)}, mode="sync")
    lines = [r.getMessage() for r in caplog.records if r.name == "mpckpt" and r.levelno == logging.INFO]
    assert [line.split(" to ")[0] for line in lines] == ["mpckpt: committed step 3", "mpckpt: committed step 4"]
    assert all("MiB written" in line and "persisted in" in line and "MB/s" in line for line in lines)


def test_a_save_that_is_not_due_makes_the_first_slab_in_the_background(tmp_path):
    state = {"w": torch.randn(256, 1024)}  # 1 MiB
    with mpckpt.Checkpointer(tmp_path, trigger=mpckpt.EveryNSteps(10)) as ckpt:
        assert ckpt.save(1, state) is None
        arena = ckpt._rt.arena
        wait_until(lambda: arena._slabs, 60, "the first slab, made in the background")
        # a slab big enough for the state exists before the first due save, and that save uses it
        (slab,) = arena._slabs
        assert slab.capacity >= state["w"].nbytes and not slab.in_use
        future = ckpt.save(10, state)
        assert future is not None and future.result(60) is not None
        assert slab in arena._slabs
    assert torch.equal(mpckpt.load(tmp_path)["w"], state["w"])
