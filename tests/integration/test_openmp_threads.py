"""An open Checkpointer leaves the training process with no OpenMP thread it did not have.

libgomp gives every thread that runs a parallel torch op a team of its own; once the teams add up
to more threads than CPUs, every team stops spin-waiting and each CPU training step pays for it
(docs/benchmarks.md, "an open Checkpointer"). ``openmp_probe.py`` counts the process's native
threads that are not Python threads (the OpenMP workers) before mpckpt opens and after each
thing a run does; mpckpt's own threads run their torch ops without a team (``mpckpt._threads``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from mpckpt import _threads

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not (sys.platform.startswith("linux") and torch.backends.openmp.is_available()),
                                reason="counts OpenMP threads through /proc")


def test_no_openmp_thread_is_added_by_an_open_checkpointer(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "tests/integration/openmp_probe.py"), str(tmp_path / "root")],
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    before = counts.pop("before")
    assert before >= 3, counts  # the training thread's team of 4: 3 workers at least, or the probe sees nothing
    assert counts == dict.fromkeys(counts, before), f"OpenMP threads before mpckpt opened: {before}; after: {counts}"


def test_a_serial_thread_sees_a_team_of_one_and_the_training_thread_keeps_its_own():
    def in_thread(start) -> int:
        seen: list[int] = []
        thread = start(target=lambda: seen.append(torch.get_num_threads()), name="probe")
        thread.start()
        thread.join(10)
        return seen[0]

    was = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        with _threads.executor(1, "probe") as pool:
            in_pool = pool.submit(torch.get_num_threads).result(10)
        assert (in_thread(threading.Thread), in_thread(_threads.Thread), in_pool) == (3, 1, 1)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(was)
