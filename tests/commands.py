"""Running mpckpt's command for every test that needs it: ``mpckpt_command`` as a user runs it
(``python -m mpckpt.cli ARGS`` in a subprocess, this checkout first on the path, bounded), and
``mpckpt_in_process`` (the same ``main``, in this process: no interpreter and torch to start).
A traceback on stderr fails the test unless it was expected: a user must only ever see a
message naming what to do."""

from __future__ import annotations

import contextlib
import io
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


def mpckpt_in_process(*args: object) -> subprocess.CompletedProcess[str]:
    """The same command run in this process (``mpckpt.cli.main``), its output captured: what a test
    that runs many commands uses, where the command's own start (Python, torch) is not what it
    checks. An exception the command lets out fails the test as a traceback would."""
    from mpckpt.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as e:  # (argparse's refusals)
            code = e.code if isinstance(e.code, int) else 1
    return subprocess.CompletedProcess(["mpckpt", *map(str, args)], code, out.getvalue(), err.getvalue())
