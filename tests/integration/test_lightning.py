"""MpckptCheckpointIO under a real Lightning Trainer (CPU, a tiny model, a few steps).

Top-k deletion and ``save_last``, resuming from ``"last"`` exactly as an uninterrupted run,
``validate`` / ``test`` with ``ckpt_path``, a remove that races a pending save, files whose
save never committed, failures surfacing, and DDP with two CPU processes. The default root lies
beside the checkpoint folder (``<dirpath>.mpckpt``), and a root at the old default inside it
(``<dirpath>/.mpckpt``) that holds checkpoints is kept. Run as a script
(``python tests/integration/test_lightning.py ddp DIR``) it is the DDP job the last test starts.
What the files are and that nothing stays open: ``test_lightning_files.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

L = pytest.importorskip("lightning") if __name__ != "__main__" else __import__("lightning")

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch import nn  # noqa: E402

import mpckpt  # noqa: E402
from mpckpt.integrations import lightning_files  # noqa: E402
from mpckpt.integrations.lightning import MpckptCheckpointIO, read_pointer  # noqa: E402
from tests.integration.gated_backend import gated_url  # noqa: E402
from tests.waiting import wait_until  # noqa: E402

OPTIONS = {"workers": 1, "memory_budget": "64MiB"}


class Net(L.LightningModule):
    def __init__(self, lr: float = 0.01, extra: object = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], i: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], i: int) -> None:
        self.log("val_loss", self._loss(batch))

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], i: int) -> None:
        self.log("test_loss", self._loss(batch))

    def configure_optimizers(self) -> object:
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.7)]

    def _loader(self, seed: int) -> torch.utils.data.DataLoader:
        g = torch.Generator().manual_seed(seed)
        data = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 2, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=8)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return self._loader(0)

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return self._loader(0)  # the training data: val_loss falls every epoch, so every epoch saves

    def test_dataloader(self) -> torch.utils.data.DataLoader:
        return self._loader(2)


def trainer(dirpath: Path, epochs: int, *, io: object = None, top_k: int = 2, **kw: object) -> tuple[object, object]:
    mc = ModelCheckpoint(dirpath=dirpath, monitor="val_loss", save_top_k=top_k, save_last=True)
    plugins = [io if io is not None else MpckptCheckpointIO(**OPTIONS)]
    t = L.Trainer(max_epochs=epochs, plugins=plugins, callbacks=[mc], logger=False, enable_progress_bar=False,
                  enable_model_summary=False, accelerator="cpu", devices=1, **kw)
    return t, mc


def root_of(dirpath: Path) -> Path:
    """The default root of the files in ``dirpath``: beside it, ``<dirpath>.mpckpt``."""
    return dirpath.with_name(dirpath.name + ".mpckpt")


def file_steps(dirpath: Path, root: Path | str | None = None) -> dict[str, list[int]]:
    """Each file the root's committed steps were saved for, and those steps."""
    out: dict[str, list[int]] = {}
    with mpckpt.Checkpointer(root or root_of(dirpath), read_only=True) as r:
        for step in r.steps():
            out.setdefault(str(r.checkpoint(step).metrics["lightning_file"]), []).append(step)
    return out


def checkpoint_files(dirpath: Path) -> list[str]:
    """The Lightning checkpoints in ``dirpath`` (files torch.load reads, not pointers)."""
    names = sorted(p.name for p in dirpath.glob("*.ckpt"))
    assert all(read_pointer(dirpath / name) is None for name in names)
    return names


def committed(dirpath: Path, root: Path | str | None = None) -> list[int]:
    with mpckpt.Checkpointer(root or root_of(dirpath), read_only=True) as r:
        return r.steps()


def written(path: Path, timeout_s: float = 60) -> None:
    """Wait until the file at ``path`` is a checkpoint, no longer a pointer."""
    wait_until(lambda: read_pointer(path) is None, timeout_s, f"{path} to be a checkpoint", poll_s=0.05)


def weights(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_top_k_and_last_keep_exactly_what_lightning_keeps(tmp_path: Path) -> None:
    torch.manual_seed(0)
    t, mc = trainer(tmp_path, 5)
    model = Net()
    t.fit(model)
    files = file_steps(tmp_path)
    # top 2 by val_loss plus last.ckpt; every file is a checkpoint held by one committed step, nothing else is left
    assert sorted(files) == checkpoint_files(tmp_path) and len(files) == 3 and "last.ckpt" in files
    assert Path(mc.best_model_path).name in files and Path(mc.last_model_path).name == "last.ckpt"
    assert all(len(steps) == 1 for steps in files.values())
    assert files["last.ckpt"] == [max(committed(tmp_path))]
    last = mpckpt.load(root_of(tmp_path), step=files["last.ckpt"][0])
    assert last["global_step"] == 20 and last["epoch"] == 4
    for k, v in weights(model).items():
        torch.testing.assert_close(last["state_dict"][k], v, rtol=0, atol=0)
    from_file = torch.load(tmp_path / "last.ckpt", weights_only=True)  # the file holds the same checkpoint
    assert from_file["global_step"] == 20
    for k, v in last["state_dict"].items():
        torch.testing.assert_close(from_file["state_dict"][k], v, rtol=0, atol=0)
    ranked = sorted(mc.best_k_models.items(), key=lambda kv: float(kv[1]))
    assert mc.best_model_path == ranked[0][0]
    assert t.strategy.checkpoint_io._open == {}  # teardown closed the Checkpointer


def test_resume_from_last_and_best_continues_exactly(tmp_path: Path) -> None:
    torch.manual_seed(0)
    straight = Net()
    trainer(tmp_path / "a", 4)[0].fit(straight)

    torch.manual_seed(0)
    first = Net()
    trainer(tmp_path / "b", 2)[0].fit(first)
    torch.manual_seed(123)  # a new process would start from other weights: the checkpoint must win
    resumed = Net()
    t, mc = trainer(tmp_path / "b", 4)
    t.fit(resumed, ckpt_path="last")
    assert t.global_step == 16
    for k, v in weights(straight).items():
        torch.testing.assert_close(weights(resumed)[k], v, rtol=0, atol=0)
    assert t.lr_scheduler_configs[0].scheduler.get_last_lr() == pytest.approx([0.01 * 0.7 ** 4])

    # a plain path (best_model_path) too; the file resumed from is never deleted by top-k
    t2, _ = trainer(tmp_path / "b", 5)
    t2.fit(Net(), ckpt_path=mc.best_model_path)
    assert t2.global_step == 20
    assert Path(mc.best_model_path).exists()


def test_save_last_link_saves_once_and_resumes(tmp_path: Path) -> None:
    mc = ModelCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=2, save_last="link")
    t = L.Trainer(max_epochs=3, plugins=[MpckptCheckpointIO(**OPTIONS)], callbacks=[mc], logger=False,
                  enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1)
    t.fit(Net())
    assert os.readlink(tmp_path / "last.ckpt") == Path(mc.best_model_path).name
    assert len(committed(tmp_path)) == 2  # one step per save: the link costs nothing
    # the link leads to a checkpoint file, as the file it names is one
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == \
        torch.load(mc.best_model_path, weights_only=True)["global_step"]
    t2, mc2 = trainer(tmp_path, 4)
    t2.fit(Net(), ckpt_path="last")
    assert t2.global_step == 16


def as_crash_leaves(path: Path, root: Path) -> None:
    """Turn the checkpoint file ``path`` back into the pointer naming its committed step of ``root``."""
    with mpckpt.Checkpointer(root, read_only=True) as r:
        step = next(s for s in r.steps() if r.checkpoint(s).metrics["lightning_file"] == path.name)
        save_id = r.checkpoint(step).metrics["lightning_save_id"]
    lightning_files.write_pointer(str(path), [lightning_files.Candidate(str(root), step, save_id)])


def test_the_default_root_is_beside_the_folder_and_moves_with_it(tmp_path: Path) -> None:
    dirpath = tmp_path / "run" / "ckpts"
    io = MpckptCheckpointIO(**OPTIONS)
    t, mc = trainer(dirpath, 3, io=io)
    t.fit(Net())
    # the checkpoint folder holds Lightning's files and nothing else; the root lies beside it
    assert sorted(os.listdir(dirpath)) == checkpoint_files(dirpath) == sorted(file_steps(dirpath))
    assert sorted(os.listdir(tmp_path / "run")) == ["ckpts", "ckpts.mpckpt"]
    assert io.root_for(dirpath / "any.ckpt") == str(root_of(dirpath))
    # a crash leaves a pointer naming the root relative to the folder: the pair moves together
    as_crash_leaves(dirpath / "last.ckpt", root_of(dirpath))
    assert read_pointer(dirpath / "last.ckpt")["candidates"][0]["root"] == "../ckpts.mpckpt"
    shutil.move(tmp_path / "run", tmp_path / "moved")
    moved = tmp_path / "moved" / "ckpts" / "last.ckpt"
    assert MpckptCheckpointIO(**OPTIONS).load_checkpoint(moved)["global_step"] == 12


def test_default_root_where_nothing_lies_beside_the_folder() -> None:
    assert lightning_files.default_root("/data/run/ckpts/") == "/data/run/ckpts.mpckpt"
    assert lightning_files.default_root("s3://bkt/run/ckpts") == "s3://bkt/run/ckpts.mpckpt"
    assert lightning_files.default_root("memory://ckpts") == "memory://ckpts.mpckpt"
    assert lightning_files.default_root("s3://bkt") == "s3://bkt/.mpckpt"   # beside a bucket is another bucket
    assert lightning_files.default_root("/") == "/.mpckpt"


def test_a_root_at_the_old_default_is_kept_and_resumed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    dirpath = tmp_path / "ckpts"
    old = dirpath / ".mpckpt"   # where mpckpt put a folder's root before: what an earlier version left
    torch.manual_seed(0)
    trainer(dirpath, 2, io=MpckptCheckpointIO(root=old, **OPTIONS))[0].fit(Net())
    before = committed(dirpath, old)
    as_crash_leaves(dirpath / "last.ckpt", old)  # its last file still a pointer into the old root
    assert read_pointer(dirpath / "last.ckpt")["candidates"][0]["root"] == ".mpckpt"

    caplog.set_level("WARNING", logger="mpckpt")
    t, mc = trainer(dirpath, 4)   # the default plugin, no root=
    t.fit(Net(), ckpt_path="last")
    assert t.global_step == 16    # resumed at step 8, from the pointer's step in the old root
    said = [r.getMessage() for r in caplog.records if str(old) in r.getMessage()]
    assert len(said) == 1 and "saving there too" in said[0] and str(root_of(dirpath)) in said[0]
    # the run went on saving there: nothing beside the folder; the old run's steps went with their files
    assert not root_of(dirpath).exists()
    files = file_steps(dirpath, old)
    assert sorted(files) == checkpoint_files(dirpath) and all(len(steps) == 1 for steps in files.values())
    assert min(committed(dirpath, old)) > max(before)
    assert torch.load(mc.last_model_path, weights_only=True)["global_step"] == 16
    # moved beside the folder as the docs say (every file written), the next run takes it up there
    shutil.move(old, root_of(dirpath))
    t3, _ = trainer(dirpath, 5)
    t3.fit(Net(), ckpt_path="last")
    assert t3.global_step == 20 and sorted(os.listdir(dirpath)) == checkpoint_files(dirpath)
    files = file_steps(dirpath)
    assert sorted(files) == checkpoint_files(dirpath) and all(len(steps) == 1 for steps in files.values())


def test_validate_and_test_with_ckpt_path(tmp_path: Path) -> None:
    torch.manual_seed(0)
    t, mc = trainer(tmp_path, 3)
    t.fit(Net())
    best, last = mc.best_model_path, mc.last_model_path
    state = torch.load(best, weights_only=True)
    by_hand = Net()
    by_hand.load_state_dict(state["state_dict"])
    with torch.no_grad():
        expected = float(torch.stack([by_hand._loss(b) for b in by_hand.val_dataloader()]).mean())
    got = t.validate(Net(), ckpt_path="best", verbose=False)[0]["val_loss"]
    assert got == pytest.approx(expected, rel=1e-6)
    assert got == pytest.approx(float(mc.best_model_score), rel=1e-6)
    tested = t.test(Net(), ckpt_path=last, verbose=False)[0]["test_loss"]
    assert tested > 0


def test_remove_and_overwrite_never_race_a_pending_save(tmp_path: Path) -> None:
    gate, root = tmp_path / "gate", tmp_path / "root"  # uploads wait until the gate opens: every save is pending
    io = MpckptCheckpointIO(root=gated_url(root), storage_options={"gate": str(gate)}, **OPTIONS)
    big = {"state_dict": {"w": torch.randn(1 << 16)}, "global_step": 0, "epoch": 0}
    a, b, last = tmp_path / "a.ckpt", tmp_path / "b.ckpt", tmp_path / "last.ckpt"
    io.save_checkpoint(big, a)
    io.save_checkpoint({**big, "global_step": 1}, last)
    io.remove_checkpoint(a)                 # still uploading: deleted after its commit
    assert not a.exists()
    io.save_checkpoint({**big, "global_step": 2}, last)   # overwrite: step 1 goes once step 2's file is written
    assert [c["step"] for c in read_pointer(last)["candidates"]] == [2, 1]
    io.save_checkpoint({**big, "global_step": 3}, b)
    gate.touch()
    loaded = io.load_checkpoint(b)          # waits for its commit
    assert loaded["global_step"] == 3 and torch.equal(loaded["state_dict"]["w"], big["state_dict"]["w"])
    io.teardown()                           # waits for the files
    assert committed(tmp_path, gated_url(root)) == [2, 3]
    assert torch.load(last, weights_only=True)["global_step"] == 2 and read_pointer(last) is None
    assert io.load_checkpoint(last)["global_step"] == 2
    io.remove_checkpoint(b)                 # committed: deleted at once (a new Checkpointer opens for it)
    io.teardown()
    assert committed(tmp_path, gated_url(root)) == [2]
    assert sorted(os.listdir(tmp_path)) == ["gate", "last.ckpt", "root"]


def test_a_save_that_never_committed_falls_back_or_is_not_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    io = MpckptCheckpointIO(**OPTIONS)
    last = tmp_path / "last.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.ones(3)}, "global_step": 5}, last)
    io.teardown()
    root = str(root_of(tmp_path))
    with mpckpt.Checkpointer(root, read_only=True) as r:
        save_id = r.checkpoint(0).metrics["lightning_save_id"]
    # what a crash between save_checkpoint and the commit leaves: a newer candidate that never committed,
    # written by a process that is gone
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    monkeypatch.setattr(lightning_files.os, "getpid", lambda: int(ended.stdout))
    new, old = lightning_files.Candidate(root, 1, 7), lightning_files.Candidate(root, 0, save_id)
    lightning_files.write_pointer(str(last), [new, old])
    lightning_files.write_pointer(str(tmp_path / "stale.ckpt"), [new])
    monkeypatch.undo()
    assert io.load_checkpoint(last)["global_step"] == 5
    assert torch.load(last, weights_only=False)["global_step"] == 5  # torch.load of a pointer, trusted
    with pytest.raises(FileNotFoundError, match="mpckpt has not written: step 1 of .*never committed"):
        torch.load(tmp_path / "stale.ckpt", weights_only=False)  # its saver is gone: no wait
    # a step number saved again by a later run is not the one the file meant
    io.save_checkpoint({"state_dict": {"w": torch.zeros(3)}, "global_step": 9}, tmp_path / "other.ckpt")
    io.teardown()
    assert committed(tmp_path) == [0, 1]
    with pytest.raises(FileNotFoundError, match="mpckpt has not written: step 1 of .*never committed"):
        io.load_checkpoint(tmp_path / "stale.ckpt")
    pointer = read_pointer(last)  # a pointer as mpckpt 0.1 wrote them (JSON) still reads
    (tmp_path / "v1.ckpt").write_text(json.dumps({**pointer, "mpckpt_lightning": 1, "candidates": pointer["candidates"]}))
    assert io.load_checkpoint(tmp_path / "v1.ckpt")["global_step"] == 5
    with pytest.raises(FileNotFoundError):
        io.load_checkpoint(tmp_path / "missing.ckpt")
    torch.save({"global_step": 1}, tmp_path / "plain.ckpt")   # a torch.save checkpoint still loads
    assert io.load_checkpoint(tmp_path / "plain.ckpt") == {"global_step": 1}


class Opaque:
    pass


def test_failures_surface(tmp_path: Path) -> None:
    # refused at save: a hyperparameter mpckpt cannot store without pickle, named by its key
    t, _ = trainer(tmp_path / "a", 1)
    with pytest.raises(mpckpt.errors.StateError, match="hyper_parameters.extra"):
        t.fit(Net(extra=Opaque()))
    # in the background: the root is replaced by a file after the first commit
    io = MpckptCheckpointIO(**OPTIONS)
    io.save_checkpoint({"state_dict": {"w": torch.ones(3)}}, tmp_path / "x.ckpt")
    io.load_checkpoint(tmp_path / "x.ckpt")     # waits for the commit; the Checkpointer stays open
    written(tmp_path / "x.ckpt")
    root = root_of(tmp_path)
    shutil.rmtree(root)
    root.write_text("not a folder")
    io.save_checkpoint({"state_dict": {"w": torch.ones(3)}}, tmp_path / "y.ckpt")
    with pytest.raises(mpckpt.errors.UploadError, match="y.ckpt|step 1"):
        io.teardown()
    assert not (tmp_path / "y.ckpt").exists()   # the pointer of a save that failed is gone
    assert (tmp_path / "x.ckpt").exists()
    with pytest.raises(ValueError, match="keep"):
        MpckptCheckpointIO(keep_last=2)


def test_what_lightning_decides_is_refused_in_a_group_too() -> None:
    with pytest.raises(mpckpt.errors.ConfigError, match="does not take keep_last, trigger"):
        MpckptCheckpointIO(retention=mpckpt.Retention(keep_last=2, trigger=mpckpt.EveryNSteps(3)))
    with pytest.raises(mpckpt.errors.ConfigError, match="does not take process_group"):
        MpckptCheckpointIO(job=mpckpt.Job(process_group=False), memory=mpckpt.Memory(budget="64MiB"))


def _ddp_job(dirpath: str) -> None:
    """Two CPU processes (Lightning relaunches this script for rank 1): fit, then resume from last."""
    torch.manual_seed(0)
    mc = ModelCheckpoint(dirpath=dirpath, monitor="val_loss", save_top_k=1, save_last=True)
    t = L.Trainer(max_epochs=2, strategy="ddp", accelerator="cpu", devices=2, plugins=[MpckptCheckpointIO(**OPTIONS)],
                  callbacks=[mc], logger=False, enable_progress_bar=False, enable_model_summary=False)
    t.fit(Net())
    t2 = L.Trainer(max_epochs=3, strategy="ddp", accelerator="cpu", devices=2,
                   plugins=[MpckptCheckpointIO(**OPTIONS)], logger=False, enable_progress_bar=False,
                   enable_model_summary=False,
                   callbacks=[ModelCheckpoint(dirpath=dirpath, monitor="val_loss", save_top_k=1, save_last=True)])
    t2.fit(Net(), ckpt_path=os.path.join(dirpath, "last.ckpt"))
    if t2.global_rank == 0:
        with open(os.path.join(dirpath, "done.json"), "w") as f:
            json.dump({"global_step": t2.global_step, "best": t2.checkpoint_callback.best_model_path}, f)


def test_ddp_two_cpu_processes(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    run = subprocess.run([sys.executable, os.path.abspath(__file__), "ddp", str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=300, cwd=os.getcwd())
    assert run.returncode == 0, run.stderr[-4000:]
    done = json.loads((tmp_path / "done.json").read_text())
    assert done["global_step"] == 6  # 2 ranks x 32 samples / 8 per batch: 2 steps per epoch, 3 epochs
    files = file_steps(tmp_path)
    assert sorted(files) == checkpoint_files(tmp_path) == sorted({"last.ckpt", Path(done["best"]).name})
    assert sorted(s for steps in files.values() for s in steps) == committed(tmp_path)
    assert mpckpt.load(root_of(tmp_path), step=files["last.ckpt"][0])["global_step"] == 6


if __name__ == "__main__":
    if sys.argv[1] == "ddp":
        _ddp_job(sys.argv[2])
