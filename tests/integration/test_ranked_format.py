"""The multi-rank format, checked in one process: a job of one rank (a real gloo group) saves
DTensors, and what readers do with a damaged or newer checkpoint, ``mpckpt info``/``export``,
``PerRank`` without a job. Whole jobs under torchrun: test_distributed.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import mpckpt
from mpckpt.errors import CorruptCheckpointError, StateError, UnsupportedFormatError
from mpckpt.format import manifest as manifest_format
from tests.conftest import assert_same


@pytest.fixture
def one_rank_job():
    """This process as the only rank of a gloo job, with a one-device CPU mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _fsdp_state(mesh):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(300, 700), torch.nn.ReLU(), torch.nn.Linear(700, 5))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 300)).sum().backward()
    opt.step()
    return model, opt


def _save(root, mesh):
    model, opt = _fsdp_state(mesh)
    state = {"model": model, "optim": opt, "rng": mpckpt.PerRank(mpckpt.RNGState()), "epoch": 3}
    with mpckpt.Checkpointer(root) as ckpt:
        ckpt.save(1, state)
    return {k: v.full_tensor() for k, v in model.state_dict().items()}


def test_a_one_rank_job_writes_the_multi_rank_format_and_loads_whole(tmp_path, one_rank_job):
    full = _save(tmp_path, one_rank_job)
    folder = tmp_path / "step_0000000001"
    names = sorted(p.name for p in folder.iterdir())
    assert "r00000-skeleton.json" in names and "skeleton.json" not in names
    assert all(n.startswith("r00000-") for n in names if n != "manifest.json")
    body = json.loads((folder / "manifest.json").read_text())
    assert body["format_version"] == 4 and body["world_size"] == 1
    loaded = mpckpt.load(tmp_path)
    assert_same(loaded["model"], full)
    assert loaded["epoch"] == 3 and isinstance(loaded["rng"], list) and len(loaded["rng"]) == 1
    assert set(loaded["rng"][0]) >= {"torch"}


def test_a_damaged_block_is_named_by_load_and_verify(tmp_path, one_rank_job):
    _save(tmp_path, one_rank_job)
    shard = max((tmp_path / "step_0000000001").glob("r00000-shard-*.safetensors"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=rf"{shard.name}.*block \d+ .*does not match"):
        mpckpt.load(tmp_path)
    done = subprocess.run([sys.executable, "-m", "mpckpt.cli", "verify", str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1 and shard.name in done.stdout + done.stderr


def test_an_older_reader_refuses_a_multi_rank_checkpoint(tmp_path, one_rank_job, monkeypatch):
    _save(tmp_path, one_rank_job)
    monkeypatch.setattr(manifest_format, "FORMAT_VERSION", 3)
    with pytest.raises(UnsupportedFormatError, match="Upgrade mpckpt"):
        mpckpt.load(tmp_path)


def test_info_and_export_show_global_tensors(tmp_path, one_rank_job):
    full = _save(tmp_path, one_rank_job)
    done = subprocess.run([sys.executable, "-m", "mpckpt.cli", "info", str(tmp_path), "1", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    shapes = {t["name"]: t["shape"] for t in json.loads(done.stdout)["tensors"]}
    assert shapes["model.0.weight"] == [700, 300] and shapes["optim.state.0.exp_avg"] == [700, 300]
    out = tmp_path / "model.safetensors"
    done = subprocess.run([sys.executable, "-m", "mpckpt.cli", "export", str(tmp_path), "1", "--to", str(out),
                           "--prefix", "model."], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    from safetensors.torch import load_file

    assert_same(dict(sorted(load_file(out).items())), dict(sorted(full.items())))


def test_restore_in_a_one_rank_job_is_bit_identical_and_keeps_dtensors(tmp_path, one_rank_job):
    full = _save(tmp_path, one_rank_job)
    model, _ = _fsdp_state(one_rank_job)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # fresh: no state yet
    state = {"model": model, "optim": opt, "rng": mpckpt.PerRank(mpckpt.RNGState()), "epoch": 0}
    with mpckpt.Checkpointer(tmp_path) as ckpt:
        assert ckpt.restore(state) == 1
        assert ckpt.stats.restored_bytes > 0
    assert_same({k: v.full_tensor() for k, v in model.state_dict().items()}, full)
    assert state["epoch"] == 3
    moments = opt.state[next(iter(opt.state))]
    assert type(moments["exp_avg"]).__name__ == "DTensor"


def test_a_partial_dtensor_is_refused_with_its_key(tmp_path, one_rank_job):
    from torch.distributed.tensor import DTensor, Partial

    partial = DTensor.from_local(torch.ones(4), one_rank_job, [Partial()])
    with mpckpt.Checkpointer(tmp_path) as ckpt, pytest.raises(StateError, match=r"'grads\.w' is a DTensor with placement .*Shard and Replicate"):
        ckpt.save(1, {"grads": {"w": partial}})


def test_per_rank_without_a_job(tmp_path):
    torch.manual_seed(5)
    state = {"w": torch.ones(3), "pos": mpckpt.PerRank({"batch": 7, "order": torch.arange(4)})}
    with mpckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state)
        ckpt.wait()
        live = {"w": torch.zeros(3), "pos": mpckpt.PerRank({"batch": 0, "order": torch.zeros(4, dtype=torch.long)})}
        assert ckpt.restore(live) == 1
    assert live["pos"].value["batch"] == 7 and torch.equal(live["pos"].value["order"], torch.arange(4))
    loaded = mpckpt.load(tmp_path)
    assert isinstance(loaded["pos"], list) and loaded["pos"][0]["batch"] == 7  # every rank's value: one
    with pytest.raises(TypeError):
        mpckpt.PerRank(mpckpt.PerRank(1))
