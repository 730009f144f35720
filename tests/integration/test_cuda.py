"""CUDA tensors: device-to-host on mpckpt's own stream into pinned slabs, small ones gathered on the
device first (``_stage.device``), restored bit-identical. Needs a GPU (skipped without one).

``torch.cuda._sleep`` holds a stream busy for a while: work queued behind it has not run yet when
``save`` is called, so a copy not ordered after it would read the old bytes."""

from __future__ import annotations

import pytest
import torch

import mpckpt
from mpckpt import _testing
from tests.conftest import assert_same

SPIN = 50_000_000  # GPU cycles of torch.cuda._sleep: tens of milliseconds

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


def many_small_model() -> torch.nn.Module:
    """About 600 small parameters (gathered on the device), one large one (copied alone), and
    BatchNorm buffers that every forward changes in place."""
    torch.manual_seed(1)
    layers = [torch.nn.Linear(16, 16) for _ in range(300)]
    return torch.nn.ModuleDict({"small": torch.nn.Sequential(*layers), "big": torch.nn.Linear(1024, 1024),
                                "norm": torch.nn.BatchNorm1d(16)}).cuda()


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.randn(8, 16, device="cuda")
    loss = model["small"](model["norm"](x)).sum() + model["big"](torch.randn(2, 1024, device="cuda")).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()


def cpu_copy(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    torch.cuda.synchronize()
    return {"model": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
            "optim": {i: {k: (v.cpu().clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
                      for i, s in opt.state_dict()["state"].items()}}


def same_as(expected: dict, loaded: dict) -> None:
    assert_same(dict(sorted(loaded["model"].items())), dict(sorted(expected["model"].items())))
    for i, per_param in expected["optim"].items():
        got = loaded["optim"]["state"][i]
        for k, v in per_param.items():
            if isinstance(v, torch.Tensor):
                assert_same(got[k], v)
            else:
                assert got[k] == v


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("overlap", [False, True])
def test_a_save_holds_its_steps_values_while_training_goes_on(tmp_path, overlap, keep):
    """Each save holds exactly the state of its step, though the next forward (BatchNorm's
    buffers), backward and optimizer step are queued right behind it on the training stream.
    ``keep``: the snapshot is also kept in memory (an eager save hashes it in the background)."""
    model = many_small_model()
    opt = torch.optim.Adam(model.parameters())  # its "step" counters stay on the CPU
    train_step(model, opt)
    expected = {}
    with mpckpt.Checkpointer(tmp_path, workers=2, keep_in_memory=keep) as ckpt:
        for step in range(4):
            expected[step] = cpu_copy(model, opt)
            torch.cuda._sleep(SPIN)  # the stream is busy: the copies must wait for it, not race it
            ckpt.save(step, {"model": model, "optim": opt}, overlap=overlap)
            train_step(model, opt)  # changes buffers at once, parameters and moments at its step
        ckpt.wait()
    for step, values in expected.items():
        same_as(values, mpckpt.load(tmp_path, step=step))


def test_work_queued_before_a_save_is_in_it(tmp_path):
    """A change queued on the training stream before ``save`` (not yet run) is what gets saved."""
    big = torch.zeros(64 << 18, device="cuda")  # 64 MiB: copied alone
    small = [torch.zeros(100, device="cuda") for _ in range(50)]  # gathered
    with mpckpt.Checkpointer(tmp_path, workers=2) as ckpt:
        for step in range(3):
            torch.cuda._sleep(SPIN)  # the scenario: the stream is busy, the additions queue behind it
            big.add_(1)
            for t in small:
                t.add_(1)
            ckpt.save(step, {"big": big, "small": small}, overlap=bool(step % 2))
        ckpt.wait()
    loaded = mpckpt.load(tmp_path, step=2)
    assert torch.equal(loaded["big"], torch.full_like(big, 3).cpu())
    assert all(torch.equal(t, torch.full((100,), 3.0)) for t in loaded["small"])


def test_twenty_thousand_tensors_of_mixed_dtypes_round_trip(tmp_path):
    torch.manual_seed(2)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.float64]
    state = {f"t{i}": torch.randint(0, 100, (i % 37 + 1,), device="cuda").to(dtypes[i % len(dtypes)])
             for i in range(20_000)}
    state["bool"] = torch.rand(999, device="cuda") > 0.5
    state["complex"] = torch.randn(33, dtype=torch.complex128, device="cuda")
    with mpckpt.Checkpointer(tmp_path, workers=3) as ckpt:
        ckpt.save(0, state, mode="sync")
        for t in state.values():
            t.zero_() if t.dtype is not torch.bool else t.logical_not_()
        ckpt.save(1, state, mode="sync")  # the same plan again, other bytes
    loaded = mpckpt.load(tmp_path, step=1)
    assert loaded.keys() == state.keys()
    for k, t in state.items():
        assert_same(loaded[k], t.cpu())


def test_a_state_on_the_gpu_and_the_cpu_restores_to_each_device(tmp_path):
    """bf16 parameters on the GPU, fp32 master copies and moments there too, step counters and a
    loose tensor on the CPU; restored from memory and from storage into live tensors."""
    torch.manual_seed(3)
    master = torch.nn.Linear(256, 256).cuda()
    opt = torch.optim.AdamW(master.parameters())
    master(torch.randn(4, 256, device="cuda")).sum().backward()
    opt.step()
    state = {"bf16": {k: v.detach().to(torch.bfloat16) for k, v in master.state_dict().items()},
             "master": master, "optim": opt, "counter": torch.tensor([7], dtype=torch.int64)}
    expected = cpu_copy(master, opt)
    ckpt = mpckpt.Checkpointer(tmp_path, workers=2)
    ckpt.save(5, state, mode="sync")
    ckpt.save(6, state, mode="memory")
    ckpt.close(leave_in_memory=True)  # as a crash leaves it
    for source in ("memory", "storage"):
        fresh = torch.nn.Linear(256, 256).cuda()
        fresh_opt = torch.optim.AdamW(fresh.parameters())
        target = {"bf16": {k: torch.zeros_like(v) for k, v in state["bf16"].items()}, "master": fresh,
                  "optim": fresh_opt, "counter": torch.tensor([0], dtype=torch.int64)}
        again = mpckpt.Checkpointer(tmp_path, workers=1)
        assert again.restore(target) == (6 if source == "memory" else 5)
        assert again.last_restore.source == source
        again.close(leave_in_memory=False)  # the kept step 6 is gone: the next restore reads storage
        assert all(t.is_cuda for t in target["bf16"].values()) and next(fresh.parameters()).is_cuda
        for k, v in state["bf16"].items():
            assert_same(target["bf16"][k].cpu(), v.cpu())
        assert_same({k: v.detach().cpu() for k, v in fresh.state_dict().items()}, expected["model"])
        assert int(target["counter"]) == 7
