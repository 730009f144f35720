"""A checkpoint root on a small filesystem that fills up: ENOSPC must fail cleanly.

The test mounts its own small filesystem (a tmpfs of a few MiB, else an ext4 loop file) under
``tmp_path``, commits a small checkpoint, fills most of what is left with a filler file and
saves a state bigger than the space that remains. The failure must surface as ``UploadError``
caused by ``StorageFullError``; the earlier checkpoint must still load bit-identical, the
failed step must leave no folder (nor a staging folder), the shared memory it used must be
free again, and once the filler is deleted the next save must succeed. Skipped, with the
reason, only where this machine lets us mount neither.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import mpckpt
from mpckpt import _testing
from mpckpt.errors import StorageFullError, UploadError
from tests.conftest import assert_same

SIZE_MIB = 8
BOUND_S = 60


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


def _mount_small_fs(where: Path, scratch: Path) -> str:
    """Mount a small filesystem at ``where``; return how, or raise ``OSError`` with why not."""
    reasons = []
    if shutil.which("mount") is None:
        raise OSError("no `mount` program")
    done = _run("mount", "-t", "tmpfs", "-o", f"size={SIZE_MIB}m", "tmpfs", str(where))
    if done.returncode == 0:
        return "tmpfs"
    reasons.append(f"tmpfs: {done.stderr.strip()}")
    image = scratch / "disk.img"
    steps = [("truncate", "-s", f"{2 * SIZE_MIB}M", str(image)), ("mkfs.ext4", "-q", "-F", str(image)),
             ("mount", "-o", "loop", str(image), str(where))]
    for cmd in steps:
        if shutil.which(cmd[0]) is None:
            reasons.append(f"loop file: no `{cmd[0]}`")
            break
        done = _run(*cmd)
        if done.returncode != 0:
            reasons.append(f"loop file: `{' '.join(cmd[:2])}` failed: {done.stderr.strip()}")
            break
    else:
        return "ext4 loop file"
    raise OSError("; ".join(reasons))


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    where = tmp_path / "mnt"
    where.mkdir()
    try:
        how = _mount_small_fs(where, tmp_path)
    except OSError as e:
        pytest.skip(f"cannot mount a small filesystem here (needs root and mount permission): {e}")
    print(f"\nsmall filesystem: {how}, {shutil.disk_usage(where).free >> 10} KiB free")
    try:
        yield where
    finally:
        if _run("umount", str(where)).returncode != 0:
            _run("umount", "-l", str(where))


def _state(seed: int, mib: float) -> dict:
    g = torch.Generator().manual_seed(seed)
    numel = int(mib * (1 << 20)) // 4 // 4
    return {"layers": [torch.randn(numel, generator=g) for _ in range(4)], "seed": seed}


def _fill(path: Path, leave_bytes: int) -> int:
    """Write a filler file leaving about ``leave_bytes`` free; return its size."""
    free = shutil.disk_usage(path.parent).free
    size = max(0, free - leave_bytes)
    with open(path, "wb") as f:
        chunk = b"\xa5" * (1 << 20)
        left = size
        while left > 0:
            left -= f.write(chunk[:min(left, len(chunk))])
        f.flush()
        os.fsync(f.fileno())
    return size


def _chain(e: BaseException | None) -> list[BaseException]:
    out = []
    while e is not None and e not in out:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def test_enospc_fails_the_save_cleanly_and_the_next_save_succeeds(small_fs: Path) -> None:
    root = small_fs / "run"
    first = _state(0, 0.5)
    big = _state(1, 4)
    with mpckpt.Checkpointer(root, workers=2, memory_budget="64MiB", timeout_s=BOUND_S) as ckpt:
        ckpt.save(0, first, mode="sync")
        filler = small_fs / "filler.bin"
        _fill(filler, leave_bytes=1 << 20)  # 1 MiB left for a 4 MiB state
        free_before = shutil.disk_usage(small_fs).free

        future = ckpt.save(1, big)
        with pytest.raises(UploadError) as info:
            future.result(BOUND_S)
        assert info.value.step == 1
        full = [e for e in _chain(info.value) if isinstance(e, StorageFullError)]
        assert full, f"no StorageFullError in the cause chain of {info.value!r}"
        assert "space" in str(full[0]).lower(), str(full[0])
        assert ckpt.steps() == [0]
        assert sorted(os.listdir(root)) == [".mpckpt.lock", "step_0000000000"]  # no step 1, no staging folder
        assert shutil.disk_usage(small_fs).free >= free_before  # what the failed save wrote is gone
        assert all(not slab.in_use for slab in _testing.slabs(ckpt))
        assert_same({"layers": first["layers"], "seed": 0}, ckpt.load(0))

        filler.unlink()
        assert ckpt.save(2, big, mode="sync").result(BOUND_S).name == "step_0000000002"
        assert ckpt.steps() == [0, 2]
    assert_same(first, mpckpt.load(root, step=0))
    assert_same(big, mpckpt.load(root, step=2))
    print(f"ENOSPC surfaced as: {info.value}")


def test_a_job_whose_uploads_fail_keeps_its_collectives_in_step(small_fs: Path, tmp_path: Path) -> None:
    """With ``preemption=True`` every ``save`` of a job agrees in a collective. A rank whose ``save`` raises
    an upload's failure the others already saw must still take part in it (else every later collective
    of the job, the training's own included, pairs with the wrong one), and no rank takes that step:
    the others' ``save`` raises a ``RankError`` naming it. The saves after it go on on every rank."""
    from tests.launch import torchrun

    root, out = small_fs / "run", tmp_path / "out"
    out.mkdir()
    _fill(small_fs / "filler.bin", leave_bytes=16 << 10)  # room to open the root, none for a shard
    torchrun(2, root, out, log=tmp_path / "job.log", worker=str(Path(__file__).with_name("full_disk_job.py")),
             timeout_s=4 * BOUND_S)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["sum"] for r in ranks] == [3.0, 3.0]
    first, second = ranks[0]["saves"], ranks[1]["saves"]
    assert first["2"].startswith("UploadError: step 1: ") and "StorageFullError" in first["2"], first
    assert second["1"].startswith("UploadError: step 1: "), second  # seen by result(): never raised again
    assert second["2"].startswith("RankError [0]: step 2 is not saved: rank(s) [0] raised an earlier"), second
    assert [first["3"], first["4"], second["3"], second["4"]] == ["saved"] * 4, ranks
