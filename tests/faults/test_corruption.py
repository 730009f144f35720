"""Damage a committed local checkpoint on disk; loading must refuse it and fallback must skip it.

One kind of damage per case, always to the newest of three committed checkpoints: a flipped
byte in a shard, a truncated shard, a missing shard, a missing manifest, a torn manifest (cut
in half), a flipped byte in ``skeleton.json``. Then:

- ``mpckpt.load(root, step=s)`` raises ``CorruptCheckpointError`` naming the damaged file
  (``CheckpointNotFoundError`` where the manifest is gone: such a folder is no checkpoint);
- opening a ``Checkpointer`` deletes nothing that has a manifest, damaged or not;
- ``restore(state, fallback=True)`` restores the newest older checkpoint, bit for bit, moves the
  damaged one aside whole (``damaged.step_*``, every byte kept) and the run saves its step again;
- ``restore(state)`` without fallback raises instead of silently going back in time, and the
  error names the root, which older step is intact, and both ways on; the state is as it was,
  except after a flipped shard byte, whose shard was read into the live tensors before its
  checksum was known: then the error says that the state is undefined.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import mpckpt
from mpckpt.errors import CheckpointNotFoundError, CorruptCheckpointError
from tests.conftest import assert_same

STEPS = (0, 1, 2)
DAMAGED = 2


def state_for(step: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(100 + step)
    return {
        "model": {"w": torch.randn(128, 64, generator=g), "b": torch.randn(64, generator=g).to(torch.bfloat16)},
        "optim": {"m": torch.randn(128, 64, generator=g).to(torch.float16), "count": torch.tensor(step)},
        "step": step,
        "note": f"saved at {step}",
    }


def blank_state() -> dict[str, object]:
    return {
        "model": {"w": torch.zeros(128, 64), "b": torch.zeros(64, dtype=torch.bfloat16)},
        "optim": {"m": torch.zeros(128, 64, dtype=torch.float16), "count": torch.tensor(-1)},
        "step": -1,
        "note": "",
    }


def _folder(root, step: int):
    return root / f"step_{step:010d}"


def _shard(folder) -> str:
    shards = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    assert shards, os.listdir(folder)
    return shards[0]


def _flip(path, where: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    i = min(len(data) - 1, int(len(data) * where))
    data[i] ^= 0x5A
    path.write_bytes(bytes(data))


def flip_shard(folder) -> str:
    name = _shard(folder)
    _flip(folder / name, 0.7)  # inside the tensor data, past the header
    return name


def truncate_shard(folder) -> str:
    name = _shard(folder)
    p = folder / name
    os.truncate(p, p.stat().st_size - 100)
    return name


def remove_shard(folder) -> str:
    name = _shard(folder)
    os.unlink(folder / name)
    return name


def remove_manifest(folder) -> str:
    os.unlink(folder / "manifest.json")
    return "manifest.json"


def tear_manifest(folder) -> str:
    p = folder / "manifest.json"
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    return "manifest.json"


def flip_skeleton(folder) -> str:
    _flip(folder / "skeleton.json", 0.5)
    return "skeleton.json"


def _cases(kinds):
    return list(kinds)


DAMAGE = {
    "flipped-shard-byte": flip_shard,
    "truncated-shard": truncate_shard,
    "missing-shard": remove_shard,
    "missing-manifest": remove_manifest,
    "torn-manifest": tear_manifest,
    "flipped-skeleton-byte": flip_skeleton,
}


@pytest.fixture
def committed(tmp_path):
    root = tmp_path / "run"
    with mpckpt.Checkpointer(root, workers=2) as ckpt:
        for step in STEPS:
            ckpt.save(step, state_for(step))
    assert ckpt.steps() == list(STEPS)
    return root


def _damage(root, kind: str) -> str:
    return DAMAGE[kind](_folder(root, DAMAGED))


@pytest.mark.parametrize("kind", _cases(DAMAGE))
def test_load_refuses_and_names_the_damaged_file(committed, kind):
    damaged = _damage(committed, kind)
    if kind == "missing-manifest":
        with pytest.raises(CheckpointNotFoundError, match=f"step {DAMAGED}"):
            mpckpt.load(committed, step=DAMAGED)
    else:
        with pytest.raises(CorruptCheckpointError) as info:
            mpckpt.load(committed, step=DAMAGED)
        assert damaged in str(info.value), str(info.value)
        assert f"step_{DAMAGED:010d}" in str(info.value), str(info.value)
    # the older checkpoints are untouched and still load bit for bit
    assert_same(state_for(DAMAGED - 1), mpckpt.load(committed, step=DAMAGED - 1))


@pytest.mark.parametrize("kind", _cases(DAMAGE))
def test_fallback_restores_the_newest_older_checkpoint(committed, kind):
    _damage(committed, kind)
    state = blank_state()
    with mpckpt.Checkpointer(committed, workers=1) as ckpt:
        assert ckpt.restore(state, fallback=True) == DAMAGED - 1
    assert_same(state_for(DAMAGED - 1), state)


@pytest.mark.parametrize("kind", _cases(k for k in DAMAGE if k not in ("missing-manifest", "torn-manifest")))
def test_restore_without_fallback_raises(committed, kind):
    damaged = _damage(committed, kind)
    state = blank_state()
    with mpckpt.Checkpointer(committed, workers=1) as ckpt:
        with pytest.raises(CorruptCheckpointError) as info:
            ckpt.restore(state)
    message = str(info.value)
    assert damaged in message
    assert str(committed) in message
    assert f"The newest intact checkpoint is step {DAMAGED - 1}" in message
    assert "restore(state, fallback=True)" in message and "--damaged" in message  # both ways on
    if kind == "flipped-shard-byte":  # its bytes went into the live tensors before the checksum was known
        assert info.value.state_changed and "the state is undefined" in message
    else:
        assert_same(blank_state(), state)  # nothing half-applied


def test_the_error_says_when_no_older_checkpoint_verifies(committed):
    for step in STEPS:
        folder = _folder(committed, step)
        _flip(folder / _shard(folder))
    with mpckpt.Checkpointer(committed, workers=1) as ckpt, pytest.raises(CorruptCheckpointError) as info:
        ckpt.restore(blank_state())
    assert "None of the 2 next older checkpoints verifies either" in str(info.value)
    with mpckpt.Checkpointer(committed, workers=1) as ckpt, pytest.raises(CorruptCheckpointError, match="verifies"):
        ckpt.restore(blank_state(), fallback=True)
    assert sorted(p.name for p in committed.iterdir() if p.name.startswith("step_")) == [
        _folder(committed, s).name for s in STEPS]  # nothing moved when there is nothing to go on from


def test_restore_without_fallback_raises_on_a_torn_manifest(committed):
    _damage(committed, "torn-manifest")
    state = blank_state()
    with mpckpt.Checkpointer(committed, workers=1) as ckpt:
        with pytest.raises(CorruptCheckpointError, match="manifest.json"):
            ckpt.restore(state)


def test_a_missing_manifest_means_no_checkpoint(committed):
    """Without a manifest the folder is an unfinished save: restore goes to the older one, no error."""
    _damage(committed, "missing-manifest")
    state = blank_state()
    with mpckpt.Checkpointer(committed, workers=1) as ckpt:
        assert ckpt.steps() == [0, 1]
        assert ckpt.restore(state) == DAMAGED - 1
    assert_same(state_for(DAMAGED - 1), state)
    assert not _folder(committed, DAMAGED).exists()  # manifest-less folders are cleaned up at open


@pytest.mark.parametrize("kind", [k for k in DAMAGE if k != "missing-manifest"])
def test_opening_never_deletes_a_damaged_checkpoint(committed, kind):
    _damage(committed, kind)
    folder = _folder(committed, DAMAGED)
    before = sorted(os.listdir(folder))
    for _ in range(2):
        with mpckpt.Checkpointer(committed, workers=1) as ckpt:
            assert ckpt.latest_step is not None
    assert sorted(os.listdir(folder)) == before
    for step in STEPS[:-1]:
        assert_same(state_for(step), mpckpt.load(committed, step=step))


def test_a_damaged_step_is_not_saved_over_and_close_does_not_hang(committed):
    _damage(committed, "torn-manifest")
    before = sorted(os.listdir(_folder(committed, DAMAGED)))
    with mpckpt.Checkpointer(committed, workers=1, timeout_s=5) as ckpt:
        with pytest.raises((mpckpt.errors.StepOrderError, mpckpt.errors.CommitConflictError)):
            ckpt.save(DAMAGED, state_for(DAMAGED), mode="sync")
    assert sorted(os.listdir(_folder(committed, DAMAGED))) == before


@pytest.mark.parametrize("kind", _cases(k for k in DAMAGE if k != "missing-manifest"))
def test_fallback_sets_the_damaged_step_aside_and_the_run_goes_on(committed, kind):
    """What a job under a restarting launcher needs: restore the newest intact step, save on."""
    _damage(committed, kind)
    folder = _folder(committed, DAMAGED)
    files = {p.name: p.read_bytes() for p in folder.iterdir()}
    state = blank_state()
    with mpckpt.Checkpointer(committed, workers=1, timeout_s=60) as ckpt:
        assert ckpt.restore(state, fallback=True) == DAMAGED - 1
        assert ckpt.steps() == [0, 1]
        ckpt.save(DAMAGED, state_for(DAMAGED + 10))  # the step is saved again, with the new run's values
        ckpt.save(DAMAGED + 1, state_for(DAMAGED + 11))
    aside = [p for p in committed.iterdir() if p.name.startswith(f"damaged.step_{DAMAGED:010d}.")]
    assert len(aside) == 1, sorted(os.listdir(committed))
    assert {p.name: p.read_bytes() for p in aside[0].iterdir()} == files  # every byte kept, for a look
    assert_same(state_for(DAMAGED + 10), mpckpt.load(committed, step=DAMAGED))
    assert_same(state_for(DAMAGED + 11), mpckpt.load(committed))
    with mpckpt.Checkpointer(committed, workers=1) as ckpt:  # a later open leaves the set-aside folder alone
        assert ckpt.steps() == [0, 1, DAMAGED, DAMAGED + 1]
    assert aside[0].exists()
    listed = subprocess.run([sys.executable, "-m", "mpckpt.cli", "ls", str(committed)], capture_output=True,
                            text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    assert f"set aside: {aside[0].name}/" in listed.stderr  # mpckpt ls says it is there


