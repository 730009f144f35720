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


def test_fsdp2_on_a_cuda_mesh_saves_and_restores_as_cuda_dtensors(tmp_path):
    """A one-rank NCCL job: CUDA DTensor shards go through pinned slabs and come back on the GPU."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cuda", (1,))

        def make() -> torch.nn.Module:
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(256, 300), torch.nn.Linear(300, 8)).cuda()
            for layer in model:
                fully_shard(layer, mesh=mesh)
            return fully_shard(model, mesh=mesh)

        model = make()
        opt = torch.optim.AdamW(model.parameters())
        model(torch.randn(4, 256, device="cuda")).sum().backward()
        opt.step()
        with mpckpt.Checkpointer(tmp_path) as ckpt:
            ckpt.save(1, {"model": model, "optim": opt})
        full = {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}
        assert_same(dict(sorted(mpckpt.load(tmp_path)["model"].items())), dict(sorted(full.items())))
        fresh = make()
        with torch.no_grad():
            for p in fresh.parameters():
                p.zero_()
        fresh_opt = torch.optim.AdamW(fresh.parameters())
        with mpckpt.Checkpointer(tmp_path) as ckpt:
            assert ckpt.restore({"model": fresh, "optim": fresh_opt}) == 1
        got = {k: v.full_tensor().cpu() for k, v in fresh.state_dict().items()}
        assert_same(dict(sorted(got.items())), dict(sorted(full.items())))
        moment = fresh_opt.state[next(iter(fresh_opt.state))]["exp_avg"]
        assert type(moment).__name__ == "DTensor" and moment.to_local().is_cuda
    finally:
        dist.destroy_process_group()
