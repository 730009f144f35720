"""Unchanged frozen weights are neither copied again nor rewritten; they are referenced."""

from __future__ import annotations

import json
import os

import torch

import mpckpt
from tests.conftest import assert_same


class LoraModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.base = torch.nn.Linear(512, 512)
        self.base.requires_grad_(False)
        self.down = torch.nn.Linear(512, 4, bias=False)
        self.up = torch.nn.Linear(4, 512, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


def _train(model: LoraModel, opt: torch.optim.Optimizer, seed: int) -> None:
    x = torch.randn(8, 512, generator=torch.Generator().manual_seed(seed))
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def _manifest(root, step) -> dict:
    return json.loads((root / f"step_{step:010d}" / "manifest.json").read_text())


def test_frozen_base_is_written_once_and_referenced_after(tmp_path):
    model = LoraModel()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    state = {"model": model, "optim": opt}
    base_bytes = sum(p.numel() * 4 for p in model.base.parameters())
    with mpckpt.Checkpointer(tmp_path, workers=2, keep_last=2) as ckpt:
        written = []
        for step in range(4):
            _train(model, opt, step)
            ckpt.save(step, state, mode="sync")
            written.append(ckpt.stats.saves[-1].written_bytes)
        first_snapshot = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            model.base.weight.add_(1.0)  # the frozen weights change: they must be written again
        ckpt.save(4, state, mode="sync")
        written.append(ckpt.stats.saves[-1].written_bytes)
    assert written[0] > base_bytes
    assert all(w < base_bytes / 10 for w in written[1:4]), written
    assert written[4] > base_bytes
    shared = {e.get("shared") for e in _manifest(tmp_path, 3)["files"].values()} - {None}
    assert shared and all(p.startswith("shared/step_0000000000.") for p in shared)  # written by step 0
    assert any(e.get("shared", "").startswith("shared/step_0000000004.") for e in _manifest(tmp_path, 4)["files"].values())
    assert _manifest(tmp_path, 3)["format_version"] == 3
    # keep_last=2 kept steps 3 and 4 and nothing else: the frozen shards step 3 lists live in shared/
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith("step_")) == ["step_0000000003", "step_0000000004"]
    listed = {e["shared"] for step in (3, 4) for e in _manifest(tmp_path, step)["files"].values() if "shared" in e}
    assert {f"shared/{n}" for n in os.listdir(tmp_path / "shared")} == listed  # what the kept ones list, no more
    assert_same(first_snapshot, mpckpt.load(tmp_path, step=3)["model"])
    assert_same(model.state_dict(), mpckpt.load(tmp_path, step=4)["model"])
    restored = LoraModel()
    with mpckpt.Checkpointer(tmp_path, workers=1) as again:
        again.restore({"model": restored, "optim": torch.optim.AdamW(
            [p for p in restored.parameters() if p.requires_grad], lr=1e-2)}, step=3)
    assert_same(first_snapshot, restored.state_dict())
