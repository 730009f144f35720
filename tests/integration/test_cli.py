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


def test_commands_that_read_no_tensor_start_without_torch(tmp_path):
    """``ls``, ``stats``, ``gc``, ``rm`` and every ``--help`` import only their own module: the parser
    reads the commands' help from their sources, so a listing never waits for torch's import."""
    import subprocess
    import sys

    from tests.commands import REPO

    with mpckpt.Checkpointer(tmp_path, workers=1) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"x": torch.full((4,), float(step))}, mode="sync", metrics={"loss": 1.0 / step})
    script = (
        "import contextlib, io, sys\n"
        "from mpckpt.cli import main\n"
        "for argv in (['ls', R], ['stats', R], ['gc', R], ['rm', R, '1'], ['ls', '--help'], ['export', '--help']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "        try:\n"
        "            code = main(argv)\n"
        "        except SystemExit as e:\n"
        "            code = e.code\n"
        "    assert code == 0, (argv, code)\n"
        "    assert 'torch' not in sys.modules, argv\n"
        "    if argv[-1] == '--help':  # the command's own help, its module's docstring included\n"
        "        assert 'usage: mpckpt ' + argv[0] in out.getvalue(), out.getvalue()\n"
        "        assert {'ls': 'committed checkpoints', 'export': 'safetensors'}[argv[0]] in out.getvalue(), out.getvalue()\n"
        "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", f"R = {str(tmp_path)!r}\n" + script], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
    with mpckpt.Checkpointer(tmp_path, read_only=True) as reader:
        assert reader.steps() == [2]  # rm really ran
