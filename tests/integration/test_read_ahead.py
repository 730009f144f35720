"""examples/read_ahead.py, a loop that draws its next batch before each save (as nanoGPT does), killed
after a commit and resumed, trains on the same batches as an uninterrupted run, bit for bit.

- Killed once a checkpoint is committed, then started again: every step's loss and the final state
  are the uninterrupted run's (the batch drawn ahead is in the ``LoopState``).
- The same check fails for a script that draws the batch afresh on resume (``--forget-batch``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mpckpt
from tests.conftest import assert_same

REPO = Path(__file__).resolve().parents[2]
STEPS, EVERY = 40, 10


def run(root: Path, *args: str) -> tuple[int, dict[int, str]]:
    """Run the example; its exit status and its ``step`` lines (step -> loss)."""
    done = subprocess.run([sys.executable, str(REPO / "examples" / "read_ahead.py"), "--root", str(root),
                           "--steps", str(STEPS), "--every", str(EVERY), "--trace", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    steps = {int(w[1]): w[2] for w in (line.split() for line in done.stdout.splitlines()) if w and w[0] == "step"}
    return done.returncode, steps


def killed_and_resumed(root: Path, *args: str) -> dict[int, str]:
    code, first = run(root, "--crash-after", str(2 * EVERY - 1), *args)
    assert code == 1 and max(first) == 2 * EVERY - 1, (code, sorted(first))
    code, rest = run(root, *args)
    assert code == 0 and min(rest) == 2 * EVERY, (code, sorted(rest))
    return {**first, **rest}


def test_a_batch_read_ahead_into_the_loop_state_resumes_exactly(tmp_path):
    code, straight = run(tmp_path / "straight")
    assert code == 0 and sorted(straight) == list(range(STEPS))
    assert killed_and_resumed(tmp_path / "killed") == straight
    assert_same(seeded(mpckpt.load(tmp_path / "killed")), seeded(mpckpt.load(tmp_path / "straight")))


def seeded(state: dict) -> dict:
    """``state`` without the generators the example never seeds (Python's and numpy's: each process
    starts them from the OS's entropy, and nothing in the example draws from them)."""
    state["rng"] = {k: v for k, v in state["rng"].items() if k not in ("python", "numpy")}
    assert state["rng"], "the torch generator's state is compared"
    return state


def test_a_batch_drawn_afresh_on_resume_is_caught(tmp_path):
    code, straight = run(tmp_path / "straight")
    assert code == 0
    resumed = killed_and_resumed(tmp_path / "forgot", "--forget-batch")
    assert all(resumed[s] == straight[s] for s in range(2 * EVERY))
    assert resumed[2 * EVERY] != straight[2 * EVERY]  # the step after the resume trains on another batch
