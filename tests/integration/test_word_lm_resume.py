"""examples/word_lm.py, a loop without a DataLoader, SIGKILLed and resumed, is bit-identical to one that never stopped.

The example (an LSTM language model on one long token tensor cut into batches by index) carries
its hidden state, a hand-annealed learning rate, the best validation loss, a running total, its
position in the tokens and a generator of its own in a ``LoopState``.

- Killed twice, each time once a checkpoint is committed and mid-epoch (so the hidden state
  matters), once before and once after the learning rate was annealed, and started again until
  done: every step's loss and weights, and the final model, optimizer, generators and loop
  variables, are bit for bit the uninterrupted run's.
- The same check fails for a script that leaves the hidden state out of the saved state
  (``--forget-hidden``: it resumes with a fresh hidden state, as such a script does).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mpckpt
from mpckpt.format.names import step_of
from tests.conftest import assert_same

REPO = Path(__file__).resolve().parents[2]
STEPS, EVERY, LR = 120, 10, 10.0
Steps = dict[int, list[str]]  # step -> [epoch, lr and loss as float.hex, digest of the weights]


def committed(root: Path) -> list[int]:
    """The steps with a manifest in ``root`` (a folder appears whole: a manifest means committed)."""
    if not root.exists():
        return []
    return sorted(s for p in root.iterdir() if (s := step_of(p.name)) is not None and (p / "manifest.json").exists())


def run(root: Path, *args: str, kill_once_committed: int | None = None) -> tuple[list[int], Steps]:
    """Run the example to ``STEPS``, or SIGKILL it at the first step it prints once a checkpoint of
    step ``kill_once_committed`` or later is committed; its ``resumed`` line and its step lines."""
    command = [sys.executable, str(REPO / "examples" / "word_lm.py"), "--root", str(root), "--steps", str(STEPS),
               "--every", str(EVERY), "--trace", *args]
    if kill_once_committed is not None:
        command += ["--step-sleep", "0.1"]  # time for the test to see the commit before the run ends
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout is not None
    resumed: list[int] = []
    steps: Steps = {}
    for line in proc.stdout:
        word, *fields = line.split()
        if word == "resumed":
            resumed = [int(f) for f in fields]
        elif word == "step":
            steps[int(fields[0])] = fields[1:]
            if kill_once_committed is not None and any(s >= kill_once_committed for s in committed(root)):
                os.kill(proc.pid, signal.SIGKILL)
                break  # INVARIANT: no read to the end after a kill: its uploaders may hold the pipe a while
    code = proc.wait(60)
    assert code == (-signal.SIGKILL if kill_once_committed is not None else 0), f"the example ended with {code}"
    return resumed, steps


def epoch_ends(reference: Steps) -> set[int]:
    """The steps that ended an epoch (the epoch a step line shows is the one after the step)."""
    return {s for s in reference if int(reference[s][0]) != int(reference.get(s - 1, ["0"])[0])}


def kill_and_resume(root: Path, kills: list[int], reference: Steps, *args: str) -> tuple[list[int], Steps]:
    """Run until done, killed once past each of ``kills``; every resume is checked to be mid-epoch."""
    starts, seen = [], {}
    for kill in [*kills, None]:
        latest = max(committed(root), default=-1)
        (start, *_), steps = run(root, *args, kill_once_committed=kill)
        assert start == latest + 1, (start, latest)
        if starts:
            assert start > starts[-1] and start - 1 not in epoch_ends(reference), (start, starts)
        starts.append(start)
        seen.update(steps)
    assert sorted(seen) == list(range(STEPS))
    return starts, seen


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, Steps]:
    root = tmp_path_factory.mktemp("word_lm") / "reference"
    (start, epoch, _), steps = run(root)
    assert (start, epoch) == (0, 0) and sorted(steps) == list(range(STEPS))
    return root, steps


def test_killed_twice_and_resumed_the_run_is_bit_identical(tmp_path, reference):
    reference_root, reference_steps = reference
    uninterrupted = mpckpt.load(reference_root)
    annealed = min(s for s, fields in reference_steps.items() if float.fromhex(fields[1]) < LR)
    starts, steps = kill_and_resume(tmp_path / "killed", [40, 100], reference_steps)
    assert starts[0] == 0 and 40 < starts[1] <= annealed < 100 < starts[2], (starts, annealed)
    for step, fields in steps.items():
        assert fields == reference_steps[step], f"step {step}: {fields} != {reference_steps[step]}"
    final = mpckpt.load(tmp_path / "killed")
    assert sorted(final["loop"]) == ["best_val", "epoch", "hidden", "i", "lengths", "lr", "total_loss"]
    assert isinstance(final["loop"]["hidden"], tuple) and final["loop"]["hidden"][0].shape == (2, 16, 64)
    assert_same(uninterrupted, final)  # the model, SGD's momentum, every generator and every loop variable


def test_the_check_fails_when_the_hidden_state_is_not_saved(tmp_path, reference):
    reference_root, reference_steps = reference
    starts, steps = kill_and_resume(tmp_path / "forgot", [40], reference_steps, "--forget-hidden")
    before, after = range(starts[1]), range(starts[1], STEPS)
    assert all(steps[s] == reference_steps[s] for s in before)  # the same run until the kill
    assert steps[starts[1]][2] != reference_steps[starts[1]][2]  # the first loss after the resume differs already
    assert all(steps[s][3] != reference_steps[s][3] for s in after)  # and the weights after every step
    final, uninterrupted = mpckpt.load(tmp_path / "forgot"), mpckpt.load(reference_root)
    assert not torch.equal(final["model"]["decoder.weight"], uninterrupted["model"]["decoder.weight"])
    with pytest.raises(AssertionError):
        assert_same(uninterrupted, final)
