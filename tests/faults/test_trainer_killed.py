"""SIGKILL the training process during asynchronous uploads; the next open must recover."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import psutil
import pytest

import mpckpt
from mpckpt._system import shm as _shm
from tests.conftest import assert_same
from tests.faults.trainer import state_for
from tests.waiting import wait_until

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def kill_trainer_mid_upload(root: str, markers: str, rng: random.Random) -> int:
    """Start the trainer, kill it after a random number of commits; return its pid."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.faults.trainer", root, markers], cwd=REPO,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": REPO})
    target = rng.randint(1, 4)
    deadline = time.monotonic() + 60
    commits = 0
    assert proc.stdout is not None
    while commits < target and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        commits += line.startswith("committed")
    time.sleep(rng.uniform(0.0, 0.3))  # the scenario: the kill lands at a random moment of the uploads
    family = psutil.Process(proc.pid).children(recursive=True)  # its uploaders (and their server)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    assert commits >= 1, "the trainer never committed a checkpoint"
    wait_until(lambda: all(map(_ended, family)), 60, f"the killed trainer's processes {family} to die with it")
    return proc.pid


def _ended(p: psutil.Process) -> bool:
    """Gone, or a zombie no one has reaped yet (nothing of it runs)."""
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def check_recovery(root: str, dead_pid: int) -> int:
    with mpckpt.Checkpointer(root, workers=1) as ckpt:
        latest = ckpt.latest_step
        assert latest is not None
        assert not [n for n in os.listdir(root) if n.startswith(".tmp.")], "staging folders survived the open"
        assert not [n for n in _shm.list_segments() if n.startswith(f"mpckpt-{dead_pid}-")], "orphaned shm"
        loaded = ckpt.load(latest)
        steps = ckpt.steps()
    assert steps and steps[-1] == latest
    assert_same(state_for(latest), loaded)
    for name in os.listdir(root):
        if name.startswith("step_"):
            assert os.path.exists(os.path.join(root, name, "manifest.json")), f"{name} has no manifest"
    return latest


@pytest.mark.parametrize("trial", range(2))
def test_trainer_sigkilled_during_uploads_leaves_latest_committed_loadable(tmp_path, trial):
    rng = random.Random(trial)
    root, markers = str(tmp_path / "run"), str(tmp_path / "m")
    os.makedirs(markers)
    pid = kill_trainer_mid_upload(root, markers, rng)
    first = check_recovery(root, pid)
    # training resumes after the crash and commits past it
    pid = kill_trainer_mid_upload(root, markers, rng)
    assert check_recovery(root, pid) > first
