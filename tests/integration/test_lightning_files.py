"""The ``.ckpt`` files MpckptCheckpointIO leaves are Lightning checkpoints; nothing stays open after a Trainer.

What Lightning users do with the files (``load_from_checkpoint(best_model_path)``, ``torch.load``,
loading by URL, with ``weights_only`` either way), what a file still being saved says when it is
read, ``trainer.save_checkpoint`` after ``fit()`` and the ``ddp_spawn`` hand-back: each with a real
Trainer on the CPU, then no uploader process, no mpckpt thread and no writer lock may be left.
"""

from __future__ import annotations

import pickle
import secrets
import threading
from pathlib import Path

import fsspec
import psutil
import pytest
import torch

L = pytest.importorskip("lightning")

from lightning.fabric.utilities.cloud_io import _load as pl_load  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

import mpckpt  # noqa: E402
from mpckpt.integrations.lightning import MpckptCheckpointIO, read_pointer  # noqa: E402
from tests.integration.gated_backend import gated_url  # noqa: E402
from tests.integration.test_lightning import OPTIONS, Net, root_of, trainer, weights  # noqa: E402
from tests.waiting import wait_until  # noqa: E402


def mpckpt_processes() -> list[str]:
    """Live processes below this one that mpckpt started (uploaders, writers), by name."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.name().startswith("mpckpt") and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {p.name()}")
        except psutil.Error:
            continue
    return out


def mpckpt_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("mpckpt")]


def assert_nothing_open() -> None:
    # a process that was told to stop may take a moment to be reaped
    wait_until(lambda: mpckpt_processes() == [], 5, "mpckpt's processes to end", poll_s=0.05)
    assert mpckpt_threads() == []


def files_of_root(root: Path | str) -> dict[int, str]:
    """Every committed step of ``root`` and the Lightning file it was saved for."""
    with mpckpt.Checkpointer(root, read_only=True) as r:
        return {s: r.checkpoint(s).metrics["lightning_file"] for s in r.steps()}


def test_files_after_fit_load_as_lightning_checkpoints(tmp_path: Path) -> None:
    torch.manual_seed(0)
    t, mc = trainer(tmp_path, 4)
    model = Net()
    t.fit(model)
    names = sorted(p.name for p in tmp_path.glob("*.ckpt"))
    assert len(names) == 3 and "last.ckpt" in names  # top 2 and last, as with torch.save
    for name in names:  # as Lightning loads them (torch's default weights_only=True)
        ckpt = torch.load(tmp_path / name, weights_only=True)
        assert {"state_dict", "optimizer_states", "lr_schedulers", "loops", "callbacks", "hyper_parameters",
                "pytorch-lightning_version"} <= set(ckpt)
    last = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert last["global_step"] == 16 and last["epoch"] == 3
    for k, v in weights(model).items():
        torch.testing.assert_close(last["state_dict"][k], v, rtol=0, atol=0)
    # the most common way to load a Lightning model for inference, both ways of weights_only
    best = torch.load(mc.best_model_path, weights_only=True)
    for only in (None, True, False):
        loaded = Net.load_from_checkpoint(mc.best_model_path, weights_only=only)
        for k, v in weights(loaded).items():
            torch.testing.assert_close(best["state_dict"][k], v, rtol=0, atol=0)
    assert loaded.hparams.lr == 0.01
    by_url = pl_load(f"file://{mc.best_model_path}")  # a URL, through fsspec (as Lightning loads remote files)
    torch.testing.assert_close(by_url["state_dict"], best["state_dict"], rtol=0, atol=0)
    # the root keeps one checkpoint per file Lightning kept, no more
    assert sorted(files_of_root(root_of(tmp_path)).values()) == names
    assert_nothing_open()


def test_a_file_still_being_saved_says_so_and_loads_once_committed(tmp_path: Path) -> None:
    gate = tmp_path / "gate"  # the shard writes wait until this file exists
    io = MpckptCheckpointIO(root=gated_url(tmp_path / "root"), storage_options={"gate": str(gate)}, **OPTIONS)
    state = {"state_dict": {"w": torch.randn(1 << 16)}, "global_step": 3, "epoch": 0}
    path = tmp_path / "a.ckpt"
    io.save_checkpoint(state, path)  # a snapshot: the upload waits at the gate
    assert path.exists() and read_pointer(path) is not None  # Lightning's exists() checks hold
    with pytest.raises(pickle.UnpicklingError, match=r"mpckpt\.integrations\.lightning_files\.checkpoint_not_written_yet"):
        torch.load(path, weights_only=True)  # not torch's "invalid load key"
    with pytest.raises(pickle.UnpicklingError, match="checkpoint_not_written_yet"):
        Net.load_from_checkpoint(path)
    threading.Timer(0.5, gate.touch).start()
    got = torch.load(path, weights_only=False)  # trusted: waits for the commit, then loads it
    assert got["global_step"] == 3 and torch.equal(got["state_dict"]["w"], state["state_dict"]["w"])
    io.teardown()  # waits for the file to be written
    assert read_pointer(path) is None
    assert torch.equal(torch.load(path, weights_only=True)["state_dict"]["w"], state["state_dict"]["w"])
    assert_nothing_open()


def test_save_checkpoint_after_fit_is_complete_and_leaves_nothing_open(tmp_path: Path) -> None:
    torch.manual_seed(0)
    t, _ = trainer(tmp_path, 2)
    model = Net()
    t.fit(model)
    assert_nothing_open()
    final = tmp_path / "final.ckpt"
    t.save_checkpoint(final)  # outside fit(): complete on return
    ckpt = torch.load(final, weights_only=True)
    assert ckpt["global_step"] == 8
    for k, v in weights(model).items():
        torch.testing.assert_close(ckpt["state_dict"][k], v, rtol=0, atol=0)
    assert_nothing_open()
    # a new Trainer resumes from it at once and saves into the same folder and root (the lock is free)
    t2, mc2 = trainer(tmp_path, 3)
    t2.fit(Net(), ckpt_path=final)
    assert t2.global_step == 12 and torch.load(mc2.last_model_path, weights_only=True)["global_step"] == 12
    assert_nothing_open()
    # one root for all saves (root=): a Trainer after another one opens it again
    for epochs in (1, 2):
        io = MpckptCheckpointIO(root=tmp_path / "shared", **OPTIONS)
        t3, _ = trainer(tmp_path / "other", epochs, io=io)
        t3.fit(Net(), ckpt_path="last")
        t3.save_checkpoint(tmp_path / "other" / f"after-{epochs}.ckpt")
        assert_nothing_open()
    assert torch.load(tmp_path / "other" / "after-2.ckpt", weights_only=True)["global_step"] == 8


def test_after_fit_a_save_over_a_file_or_its_removal_deletes_its_step(tmp_path: Path) -> None:
    torch.manual_seed(0)
    t, mc = trainer(tmp_path, 2)
    t.fit(Net())
    before = files_of_root(root_of(tmp_path))
    assert sorted(before.values()) == sorted(p.name for p in tmp_path.glob("*.ckpt"))
    t.save_checkpoint(mc.last_model_path)  # over last.ckpt, outside fit(): written now, its old step goes
    t.strategy.remove_checkpoint(mc.best_model_path)  # as Lightning removes files: the step goes with it
    assert not Path(mc.best_model_path).exists()
    assert torch.load(mc.last_model_path, weights_only=True)["global_step"] == 8
    gone = Path(mc.best_model_path).name, "last.ckpt"  # removed, and saved over
    assert files_of_root(root_of(tmp_path)) == {s: f for s, f in before.items() if f not in gone}
    assert_nothing_open()


def test_ddp_spawn_leaves_nothing_open_and_the_trainer_pickles(tmp_path: Path) -> None:
    torch.manual_seed(0)
    mc = ModelCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=1, save_last=True)
    t = L.Trainer(max_epochs=2, strategy="ddp_spawn", accelerator="cpu", devices=2,
                  plugins=[MpckptCheckpointIO(**OPTIONS)], callbacks=[mc], logger=False, enable_progress_bar=False,
                  enable_model_summary=False)
    model = Net()
    t.fit(model)  # rank 0 hands the weights back through a temporary checkpoint the main process removes
    assert_nothing_open()
    pickle.dumps(t)
    last = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert last["global_step"] == 4
    for k, v in weights(model).items():  # the main process's model got the trained weights
        torch.testing.assert_close(last["state_dict"][k], v, rtol=0, atol=0)
    Net.load_from_checkpoint(mc.best_model_path)
    assert sorted(files_of_root(root_of(tmp_path)).values()) == sorted(p.name for p in tmp_path.glob("*.ckpt"))


def test_an_fsspec_folder_gets_checkpoints_too(tmp_path: Path) -> None:
    folder = f"memory://mpckpt-lightning-{secrets.token_hex(4)}"  # the root inside it lives in this process
    try:
        mc = ModelCheckpoint(dirpath=folder, monitor="val_loss", save_top_k=1, save_last=True)
        t = L.Trainer(max_epochs=2, plugins=[MpckptCheckpointIO(**OPTIONS)], callbacks=[mc], logger=False,
                      enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1)
        model = Net()
        t.fit(model)
        assert mc.best_model_path.startswith("memory://") and read_pointer(mc.best_model_path) is None
        last = pl_load(f"{folder}/last.ckpt", weights_only=True)
        assert last["global_step"] == 8
        for k, v in weights(model).items():
            torch.testing.assert_close(last["state_dict"][k], v, rtol=0, atol=0)
        Net.load_from_checkpoint(mc.best_model_path)
        assert sorted(files_of_root(f"{folder}.mpckpt").values()) == sorted(  # beside it; a URL's steps name it whole
            f"{folder}/{p.rsplit('/', 1)[1]}" for p in fsspec.filesystem("memory").ls(folder, detail=False)
            if p.endswith(".ckpt"))
        assert_nothing_open()
        assert all(p.endswith(".ckpt") for p in fsspec.filesystem("memory").ls(folder, detail=False))
    finally:
        for made in (folder, f"{folder}.mpckpt"):
            if fsspec.filesystem("memory").exists(made):
                fsspec.filesystem("memory").rm(made, recursive=True)
