"""Overlapped snapshots hold exactly the values of the save call, while training goes on."""

from __future__ import annotations

import torch

import mpckpt
from tests.conftest import assert_same


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.BatchNorm1d(1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    loss = model(torch.randn(32, 1024, generator=g)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def _clone(state: dict) -> dict:
    return {"model": {k: v.clone() for k, v in state["model"].state_dict().items()},
            "optim": {k: {n: t.clone() for n, t in v.items()} for k, v in state["optim"].state_dict()["state"].items()}}


def test_overlapped_checkpoint_is_the_state_at_the_save_call(tmp_path):
    model, opt = _model()
    state = {"model": model, "optim": opt}
    expected = {}
    with mpckpt.Checkpointer(tmp_path, workers=2, overlap=True) as ckpt:
        ckpt.restore(state)
        for step in range(8):
            _step(model, opt, step)
            if step % 2 == 1:
                expected[step] = _clone(state)
                ckpt.save(step, state)
                # training continues at once: forward changes BN buffers, step() changes everything
        saves = list(ckpt.stats.saves)
    assert [s.status for s in saves] == ["committed"] * 4
    for step, snap in expected.items():
        loaded = mpckpt.load(tmp_path, step=step)
        assert_same(snap["model"], loaded["model"])
        for k, per_param in snap["optim"].items():
            assert_same(per_param, loaded["optim"]["state"][k])


def test_snapshot_barrier_guards_manual_in_place_updates(tmp_path):
    model, opt = _model()
    _step(model, opt, 0)
    state = {"model": model, "optim": opt}
    before = _clone(state)
    with mpckpt.Checkpointer(tmp_path, workers=1) as ckpt:
        ckpt.save(0, state, overlap=True)
        ckpt.snapshot_barrier()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # an EMA-style update outside optimizer.step()
    assert_same(before["model"], mpckpt.load(tmp_path)["model"])
