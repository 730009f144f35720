"""CUDA tensors: device-to-host into (pinned) slabs, restored bit-identical. Needs a GPU."""

from __future__ import annotations

import pytest
import torch

import mpckpt
from mpckpt import _testing
from tests.conftest import assert_same

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_cuda_state_round_trips_through_pinned_slabs(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 8)).cuda()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 512, device="cuda")).sum().backward()
    opt.step()
    state = {"model": model, "optim": opt, "bf16": torch.randn(33, device="cuda").to(torch.bfloat16)}
    with mpckpt.Checkpointer(tmp_path, workers=2) as ckpt:
        ckpt.save(0, state, mode="sync")
        assert any(s.pinned for s in _testing.slabs(ckpt))
        ckpt.save(1, state, overlap=True)
        model(torch.randn(4, 512, device="cuda")).sum().backward()
        opt.step()  # waits for the overlapped copy first
    expected = {k: v.cpu() for k, v in model.state_dict().items()}
    loaded = mpckpt.load(tmp_path, step=0)
    assert loaded["model"].keys() == expected.keys()
    assert_same(state["bf16"].cpu(), loaded["bf16"])
    restored = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 8)).cuda()
    with mpckpt.Checkpointer(tmp_path, workers=1) as again:
        again.restore({"model": restored}, step=1, strict=False)  # the model alone
    assert all(p.is_cuda for p in restored.parameters())
