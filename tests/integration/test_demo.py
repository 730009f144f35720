"""The demo (the README's first command runs it): it passes, and leaves nothing in the temp
folder, also when it fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--width", "64", "--depth", "1", "--steps", "4", "--every", "2"]


def _ours(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith("mpckpt"))  # torch keeps a cache of its own


def _demo(tmp: Path, **env: str) -> subprocess.CompletedProcess:
    tmp.mkdir(exist_ok=True)
    return subprocess.run([sys.executable, str(REPO / "examples" / "demo.py"), *SMALL], cwd=REPO,
                          env={**os.environ, "TMPDIR": str(tmp), **env}, capture_output=True, text=True, timeout=300)


def test_the_demo_passes_and_cleans_up(tmp_path):
    done = _demo(tmp_path / "tmp")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "demo OK" in done.stdout
    assert _ours(tmp_path / "tmp") == []


def test_a_failing_demo_leaves_nothing_behind(tmp_path):
    done = _demo(tmp_path / "tmp", MPCKPT_MEMORY_BUDGET="lots")  # fails when the Checkpointer opens
    assert done.returncode != 0
    assert "MPCKPT_MEMORY_BUDGET" in done.stderr
    assert _ours(tmp_path / "tmp") == []


def test_the_demo_keeps_its_checkpoints_in_a_root_whose_folder_does_not_exist_yet(tmp_path):
    """The try-out of docs/guide/command-line.md: ``demo.sh --root runs/demo`` in a fresh clone, then
    ``mpckpt export``."""
    root = tmp_path / "runs" / "demo"
    done = subprocess.run([sys.executable, str(REPO / "examples" / "demo.py"), *SMALL, "--root", str(root)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == [
        "step_0000000000", "step_0000000002", "step_0000000003"]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["demo"]  # its scratch folder is gone
