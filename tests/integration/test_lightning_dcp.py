"""Lightning's sharded checkpoints through mpckpt (``lightning_dcp``), two CPU processes (gloo).

One job (this file run as a script; Lightning relaunches it for rank 1), for FSDP
(``MpckptFSDPStrategy(state_dict_type="sharded")``) and FSDP2 (``MpckptModelParallelStrategy``):
2 epochs, then a new Trainer resumes from ``"last"`` for 2 more, every save a ``dcp.save``
through mpckpt's ``StorageWriter``. The test compares each rank's parameters and optimizer
state at the end of the first run with what the resumed run starts from (``torch.equal``), and
the parameters a fresh model gets from ``test(Net(), ckpt_path="best")`` with the end of the run,
and checks the root: one committed step per file ``ModelCheckpoint`` keeps, each ``.ckpt`` path a
sharded pointer, the steps readable as full tensors by ``mpckpt.load``.
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

from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from torch import nn  # noqa: E402

import mpckpt  # noqa: E402
from mpckpt.errors import ConfigError  # noqa: E402
from mpckpt.integrations import lightning_files  # noqa: E402
from mpckpt.integrations.lightning import MpckptCheckpointIO, read_pointer  # noqa: E402
from mpckpt.integrations.lightning_dcp import MpckptFSDPStrategy, MpckptModelParallelStrategy  # noqa: E402

OPTIONS = {"workers": 1, "memory_budget": "64MiB"}


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def configure_model(self) -> None:
        if not isinstance(self.trainer.strategy, MpckptModelParallelStrategy) or getattr(self, "_sharded", False):
            return  # (test() after fit() calls it again)
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in (self.net[0], self.net[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)
        self._sharded = True

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], i: int) -> None:
        self.log("test_loss", nn.functional.mse_loss(self.net(batch[0]), batch[1]), sync_dist=True)

    def test_dataloader(self) -> torch.utils.data.DataLoader:
        return self.train_dataloader()

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


class _Started(Callback):
    """Writes this rank's state as the resumed run (``fit``, then ``test``) starts from it (after the restore)."""

    def __init__(self, to: str) -> None:
        self.to = to

    def on_train_start(self, trainer: object, module: object) -> None:
        torch.save(_local_state(trainer), self.to.format("resumed"))

    def on_test_start(self, trainer: object, module: object) -> None:
        torch.save(_local_state(trainer), self.to.format("tested"))


def _fit(kind: str, dirpath: str, epochs: int, ckpt_path: str | None = None, started: str | None = None) -> object:
    torch.manual_seed(0)
    strategy = MpckptFSDPStrategy(state_dict_type="sharded") if kind == "fsdp" else \
        MpckptModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    callbacks = [ModelCheckpoint(dirpath=dirpath, save_top_k=1, save_last=True)]  # every epoch; top-k removes
    t = L.Trainer(max_epochs=epochs, strategy=strategy, accelerator="cpu", devices=2,
                  plugins=[MpckptCheckpointIO(**OPTIONS)], callbacks=callbacks + ([_Started(started)] if started else []),
                  logger=False, enable_progress_bar=False, enable_model_summary=False)
    t.fit(Net(), ckpt_path=ckpt_path)
    return t


def _local_state(t: object) -> dict[str, object]:
    """This rank's shard of the parameters and its optimizer state."""
    params = [p.detach().clone() for p in _local_params(t)]
    opts = t.optimizers  # type: ignore[attr-defined]
    return {"params": params, "optim": opts[0].state_dict() if opts else None}


def _local_params(t: object) -> list[torch.Tensor]:
    """This rank's shard of the parameters."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = t.strategy.model  # type: ignore[attr-defined]
    if isinstance(t.strategy, MpckptFSDPStrategy):  # type: ignore[attr-defined]
        # FSDP1's flat shards (the original parameters are views FSDP points at them before a forward)
        return [m._flat_param for m in FSDP.fsdp_modules(model) if m._flat_param is not None]
    return [p.to_local() for p in model.parameters()]


def _job(kind: str, out: str) -> None:
    t = _fit(kind, out, 2)
    rank = t.global_rank  # type: ignore[attr-defined]
    torch.save(_local_state(t), os.path.join(out, f"saved_{rank}.pt"))
    t = _fit(kind, out, 4, ckpt_path="last", started=os.path.join(out, f"{{}}_{rank}.pt"))
    torch.save(_local_state(t), os.path.join(out, f"end_{rank}.pt"))
    # a fresh model (its own initial weights): test() loads the best file, the newest epoch's, into it
    t.test(Net(), ckpt_path="best", verbose=False)  # type: ignore[attr-defined]
    if rank == 0:
        with open(os.path.join(out, "done.json"), "w") as f:
            json.dump({"global_step": t.global_step, "best": t.checkpoint_callback.best_model_path}, f)  # type: ignore


KINDS = {"fsdp": ("model", "net.2.weight"), "fsdp2": ("state_dict", "net.2.weight")}


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both kinds, one after the other, in one job of two processes (each start costs seconds)."""
    out = tmp_path_factory.mktemp("sharded")
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    run = subprocess.run([sys.executable, os.path.abspath(__file__), "job", str(out)], env=env,
                         capture_output=True, text=True, timeout=500, cwd=os.getcwd())
    assert run.returncode == 0, run.stderr[-6000:]
    return out


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_sharded_saves_go_through_mpckpt_and_resume_exactly(job: Path, kind: str) -> None:
    out = job / kind
    done = json.loads((out / "done.json").read_text())
    assert done["global_step"] == 8  # 2 ranks x 32 samples / 8 per batch: 2 steps per epoch, 4 epochs
    for rank in (0, 1):
        saved = torch.load(out / f"saved_{rank}.pt", weights_only=False)
        resumed = torch.load(out / f"resumed_{rank}.pt", weights_only=False)
        assert len(saved["params"]) == len(resumed["params"]) > 0
        for a, b in zip(saved["params"], resumed["params"], strict=True):
            assert torch.equal(a, b)
        state_a, state_b = saved["optim"]["state"], resumed["optim"]["state"]
        assert state_a.keys() == state_b.keys() and state_a
        for key in state_a:
            assert state_a[key].keys() == state_b[key].keys()
            for name in ("exp_avg", "exp_avg_sq", "step"):
                a, b = (getattr(s[key][name], "to_local", lambda t=s[key][name]: t)() for s in (state_a, state_b))
                assert torch.equal(a, b), (rank, key, name)
        ended, tested = (torch.load(out / f"{n}_{rank}.pt", weights_only=False) for n in ("end", "tested"))
        for a, b in zip(ended["params"], tested["params"], strict=True):  # test(Net(), ckpt_path="best") loaded it
            assert torch.equal(a, b)
    root = out.with_name(out.name + ".mpckpt")  # the default root, beside the folder
    names = sorted(p.name for p in out.glob("*.ckpt"))
    assert names == sorted({"last.ckpt", Path(done["best"]).name})
    with mpckpt.Checkpointer(root, read_only=True) as r:
        by_file = {str(r.checkpoint(s).metrics["lightning_file"]): s for s in r.steps()}
        assert len(by_file) == len(r.steps())
    for name in names:  # each file a pointer naming its committed step; nothing else is kept
        pointer = read_pointer(out / name)
        assert pointer is not None and pointer["sharded"] is True
        assert [c.step for c in lightning_files.candidates(str(out / name), pointer)] == [by_file[name]]
    assert sorted(by_file) == names
    model_key, weight = KINDS[kind]
    state = mpckpt.load(root, step=by_file["last.ckpt"])  # full tensors: both ranks' shards joined
    assert state[model_key][weight].shape == (4, 16)
    assert state["optimizer_0"]["state"][weight]["exp_avg"].shape == (4, 16)
    assert not (out / "last.ckpt").is_dir()  # no plain DCP folder: the save went to the root
    with pytest.raises(ConfigError, match="MpckptFSDPStrategy"):  # a plain reader is told what loads it
        torch.load(out / "last.ckpt", weights_only=False)


if __name__ == "__main__":
    if sys.argv[1] == "job":
        for kind in sorted(KINDS):
            os.makedirs(os.path.join(sys.argv[2], kind), exist_ok=True)
            _job(kind, os.path.join(sys.argv[2], kind))
