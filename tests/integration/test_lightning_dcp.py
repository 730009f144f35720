"""Lightning's sharded checkpoints through mpckpt (``lightning_dcp``), two CPU processes (gloo).

One job (this file run as a script; Lightning relaunches it for rank 1): FSDP
(``state_dict_type="sharded"``) trained 4 epochs without a stop, then 2 epochs and a resume from
``"last"`` for 2 more, every save a ``dcp.save`` through mpckpt's ``StorageWriter``. The test
compares each rank's parameters and optimizer state of both runs with ``torch.equal``, and checks
the root: one committed step per file ``ModelCheckpoint`` keeps, each ``.ckpt`` path a sharded
pointer, the steps readable as full tensors by ``mpckpt.load``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

L = pytest.importorskip("lightning") if __name__ != "__main__" else __import__("lightning")

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch import nn  # noqa: E402

import mpckpt  # noqa: E402
from mpckpt.errors import ConfigError  # noqa: E402
from mpckpt.integrations import lightning_files  # noqa: E402
from mpckpt.integrations.lightning import MpckptCheckpointIO, read_pointer  # noqa: E402
from mpckpt.integrations.lightning_dcp import MpckptFSDPStrategy  # noqa: E402

OPTIONS = {"workers": 1, "memory_budget": "64MiB"}


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], i: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> object:
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=8)


def _fit(dirpath: str, epochs: int, ckpt_path: str | None = None) -> object:
    torch.manual_seed(0)
    mc = ModelCheckpoint(dirpath=dirpath, monitor="train_loss", save_top_k=1, save_last=True)
    t = L.Trainer(max_epochs=epochs, strategy=MpckptFSDPStrategy(state_dict_type="sharded"), accelerator="cpu",
                  devices=2, plugins=[MpckptCheckpointIO(**OPTIONS)], callbacks=[mc], logger=False,
                  enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=True)
    t.fit(Net(), ckpt_path=ckpt_path)
    return t


def _local_state(t: object) -> dict[str, object]:
    """This rank's shard of the parameters and its optimizer state, as trained."""
    model, opt = t.strategy.model, t.optimizers[0]  # type: ignore[attr-defined]
    return {"params": [p.detach().clone() for p in model.parameters()], "optim": opt.state_dict()}


def _job(out: str) -> None:
    whole, cut = os.path.join(out, "whole"), os.path.join(out, "cut")
    t = _fit(whole, 4)
    rank = t.global_rank  # type: ignore[attr-defined]
    torch.save(_local_state(t), os.path.join(out, f"whole_{rank}.pt"))
    _fit(cut, 2)
    t = _fit(cut, 4, ckpt_path="last")
    torch.save(_local_state(t), os.path.join(out, f"resumed_{rank}.pt"))
    if rank == 0:
        with open(os.path.join(out, "done.json"), "w") as f:
            json.dump({"global_step": t.global_step, "best": t.checkpoint_callback.best_model_path}, f)  # type: ignore


def test_fsdp_sharded_saves_go_through_mpckpt_and_resume_exactly(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    run = subprocess.run([sys.executable, os.path.abspath(__file__), "job", str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=400, cwd=os.getcwd())
    assert run.returncode == 0, run.stderr[-6000:]
    done = json.loads((tmp_path / "done.json").read_text())
    assert done["global_step"] == 8  # 2 ranks x 32 samples / 8 per batch: 2 steps per epoch, 4 epochs
    for rank in (0, 1):
        whole = torch.load(tmp_path / f"whole_{rank}.pt", weights_only=True)
        resumed = torch.load(tmp_path / f"resumed_{rank}.pt", weights_only=True)
        assert len(whole["params"]) == len(resumed["params"]) > 0
        for a, b in zip(whole["params"], resumed["params"], strict=True):
            assert torch.equal(a, b)
        state_a, state_b = whole["optim"]["state"], resumed["optim"]["state"]
        assert state_a.keys() == state_b.keys() and state_a
        for key in state_a:
            for name in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(state_a[key][name], state_b[key][name]), (rank, key, name)
    cut = tmp_path / "cut"
    root = cut / ".mpckpt"
    names = sorted(p.name for p in cut.glob("*.ckpt"))
    assert names == sorted({"last.ckpt", Path(done["best"]).name})
    with mpckpt.Checkpointer(root, read_only=True) as r:
        by_file = {str(r.checkpoint(s).metrics["lightning_file"]): s for s in r.steps()}
        latest = r.latest_step
    for name in names:  # each file a pointer naming its committed step; nothing else is kept
        pointer = read_pointer(cut / name)
        assert pointer is not None and pointer["sharded"] is True
        assert [c.step for c in lightning_files.candidates(str(cut / name), pointer)] == [by_file[name]]
    assert sorted(by_file) == names and latest == max(by_file.values())
    state = mpckpt.load(root, step=by_file["last.ckpt"])  # full tensors: both ranks' shards joined
    assert state["model"]["net.0.weight"].shape == (16, 8)
    assert state["optimizer_0"]["state"]["net.2.weight"]["exp_avg"].shape == (4, 16)
    assert not (cut / "last.ckpt").is_dir()  # no plain DCP folder: the save went to the root
    with pytest.raises(ConfigError, match="MpckptFSDPStrategy"):  # a plain reader is told what loads it
        torch.load(cut / "last.ckpt", weights_only=False)


if __name__ == "__main__":
    if sys.argv[1] == "job":
        _job(sys.argv[2])
