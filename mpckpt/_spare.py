"""A warm spare of ``python -m mpckpt.run``: a process with Python, torch and mpckpt already loaded,
waiting to become a replacement rank.

A replacement started from nothing spends its first seconds where the survivors spent theirs
long ago: the interpreter, ``import torch`` (1.5 s on this project's VM) and the compiler stack
the first optimizer a script makes imports (``torch._dynamo``: 1.3 s more), seconds to minutes
more on a busy shared filesystem. The launcher (``_supervisor``) therefore keeps ``--spares``
processes per node that did all of that while the job trained; when a rank dies it hands one the
rank's environment and command, and the spare runs the script as ``__main__`` as ``python
script.py`` (or ``python -m module``) would: ``sys.argv``, ``sys.path[0]`` and ``os.environ`` are
the rank's.

What the spare loads before it knows its rank reads no rank-specific environment at import:
torch, ``torch.distributed``, ``torch.nn.parallel``, ``torch.optim`` (one throwaway optimizer:
what imports the compiler stack) and ``mpckpt``. It is started with the environment the node's
ranks get (OpenMP reads ``OMP_NUM_THREADS`` when it loads, which is at ``import torch``).

Protocol: the launcher writes one line of JSON to the spare's stdin, ``{"env": {...}, "argv":
[script, args...] | ["-m", module, args...]}``, and closes it; end of input without a line ends
the spare with 0 (the launcher no longer needs it). The spare's exit code is the script's.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from typing import Any


def warm() -> None:
    """Load what a training script's start loads, before anything rank-specific is known."""
    import torch
    import torch.distributed  # noqa: F401
    import torch.nn.parallel  # noqa: F401

    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # imports the compiler stack optimizers use
    import mpckpt
    import mpckpt.healing  # noqa: F401

    mpckpt.Checkpointer  # noqa: B018 -- the package's names load lazily


def become(order: dict[str, Any]) -> None:
    """Take the rank's environment and command, and run it as ``__main__``."""
    os.environ.clear()
    os.environ.update(order["env"])
    argv = list(order["argv"])
    if argv[:1] == ["-m"]:
        sys.argv = argv[1:]
        sys.path[0] = os.getcwd()  # as python -m puts it
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as python script.py puts it
        runpy.run_path(argv[0], run_name="__main__")


def main() -> int:
    warm()
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    with open(os.devnull, "rb") as null:  # the order's pipe is done: the script reads no input, as a rank's
        os.dup2(null.fileno(), 0)
    become(json.loads(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
