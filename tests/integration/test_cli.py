"""The mpckpt command on real folders and real orphaned shared memory."""

from __future__ import annotations

import os

import pytest
import torch

import mpckpt
from mpckpt._system import shm as _shm
from mpckpt.cli import main


@pytest.mark.alone  # its gc must be the one that removes the orphaned segment
def test_ls_verify_and_gc(tmp_path, capsys):
    with mpckpt.Checkpointer(tmp_path, workers=1) as ckpt:
        ckpt.save(1, {"x": torch.ones(100)}, metrics={"loss": 0.5})
        ckpt.save(2, {"x": torch.zeros(100)})
    assert main(["ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "loss" in out and len(out.strip().splitlines()) == 3  # the header row, then one row a step
    assert main(["verify", str(tmp_path)]) == 0

    shard = next(p for p in (tmp_path / "step_0000000002").iterdir() if p.suffix == ".safetensors")
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert main(["verify", str(tmp_path), "--step", "2"]) == 1
    assert "checksum" in capsys.readouterr().err

    (tmp_path / ".tmp.step_0000000003.999.abcd").mkdir()
    (tmp_path / "step_0000000004").mkdir()  # no manifest: never a checkpoint
    orphan = _shm.Segment.create(4096)
    fake = orphan.name.replace(f"-{os.getpid()}-", "-999999999-")  # a creator that does not exist
    os.rename(os.path.join(_shm.SHM_DIR, orphan.name), os.path.join(_shm.SHM_DIR, fake))
    orphan.close()
    assert main(["gc", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert fake in out and ".tmp.step_0000000003" in out and "step_0000000004" in out
    assert not os.path.exists(os.path.join(_shm.SHM_DIR, fake))
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith(("step_", ".tmp"))) == \
        ["step_0000000001", "step_0000000002"]  # the damaged one is kept, never deleted


def test_gc_refuses_a_folder_a_live_trainer_writes(tmp_path, capsys):
    with mpckpt.Checkpointer(tmp_path, workers=1):
        assert main(["gc", str(tmp_path)]) == 1
    assert "another live process" in capsys.readouterr().err
