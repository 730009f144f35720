"""Imported by the uploaders' fork server when it starts (its preload), and by nothing else.

A scheduler's warning goes to the whole process group: the trainer, its uploaders and the fork
server they are forked from. An uploader is killed when its parent dies (``PR_SET_PDEATHSIG``),
and its parent is this server: so the server must outlive such a signal as the uploaders do,
or the last checkpoint of a preempted run loses its writers. The server still ends with the
trainer (it exits when the trainer's end of its pipe closes). Processes forked from it
inherit the ignored signals; ``worker_main`` ignores them anyway.
"""

from __future__ import annotations

import signal

import mpckpt._upload.worker  # noqa: F401 -- what every uploader runs, imported once here
from mpckpt._preemption import JOB_SIGNALS

for _sig in JOB_SIGNALS:
    signal.signal(_sig, signal.SIG_IGN)
