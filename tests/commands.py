"""Running mpckpt's command as a user runs it, for every test that needs it: ``mpckpt_command``
(``python -m mpckpt.cli ARGS`` in a subprocess, this checkout first on the path, bounded).
A traceback on stderr fails the test unless it was expected: a user must only ever see a
message naming what to do."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def mpckpt_command(*args: object, cwd: Path = REPO, timeout: float = 300,
                   traceback_ok: bool = False) -> subprocess.CompletedProcess[str]:
    """``python -m mpckpt.cli ARGS`` in ``cwd``; its output as text."""
    done = subprocess.run([sys.executable, "-m", "mpckpt.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=timeout)
    if not traceback_ok:
        assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return done
