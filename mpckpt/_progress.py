"""The progress bar of a long read: on a terminal, after a second, on one rank.

This module owns when loading shows a bar and how it looks. Every read path opens one with
``reading_bar(total_bytes, desc)`` and reports the bytes as they arrive with ``update(n)``,
from any of its reading threads, then ``close()``: ``_read.whole`` (a checkpoint
one process saved: ``mpckpt.load``, ``Checkpointer.load`` and ``restore``, ``mpckpt
export``) and ``_read.regions.Reader.run`` (one the ranks of a job saved, read whole or
resharded). ``reading_bar`` returns None where no bar is drawn, so a caller writes
``if bar is not None: bar.update(n)``.

A bar is drawn only when all of these hold: ``MPCKPT_PROGRESS`` is on
(``config.progress_enabled``; checked first, so a bad value is an error on every machine,
terminal or not), stderr is a terminal, tqdm is installed (an optional dependency: without
it, no bar), and this process is rank 0 of its job or in no job (every rank of a torchrun
job usually writes to one terminal: one bar, not one per rank). It appears only once the
read has lasted ``DELAY_S``: a quick load draws nothing, not even a bar that flickers and
is wiped. It is wiped when the read ends (``leave=False``), so nothing of it stays in a
terminal's scrollback or a log.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Mapping
from typing import IO, Any

from mpckpt.config import progress_enabled

DELAY_S = 1.0  # reads shorter than this draw nothing


class ReadingBar:
    """A tqdm bar that several reading threads may update at once."""

    def __init__(self, bar: Any) -> None:
        self._bar = bar
        self._lock = threading.Lock()  # tqdm's update is not atomic: n += k from two threads loses bytes

    def update(self, nbytes: int) -> None:
        with self._lock:
            self._bar.update(nbytes)

    def close(self) -> None:
        with self._lock:
            self._bar.close()


def reading_bar(total_bytes: int | None, desc: str, *, rank: int | None = None, stream: IO[str] | None = None,
                environ: Mapping[str, str] | None = None) -> ReadingBar | None:
    """A bar for a read of ``total_bytes`` (None: unknown, a running count), or None where none
    is drawn (see the module docstring). ``rank``: this process's rank in its job, when the
    caller knows it (default: torch.distributed's, if a process group is up); ``stream``:
    where to draw (default: stderr); ``environ``: for ``MPCKPT_PROGRESS`` (default: os.environ)."""
    if not progress_enabled(environ):  # the setting first: a bad value is an error anywhere
        return None
    stream = sys.stderr if stream is None else stream
    if not _is_terminal(stream) or not _first_rank(rank):
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return ReadingBar(tqdm(total=total_bytes, desc=desc, unit="B", unit_scale=True,
                           leave=False, delay=DELAY_S, file=stream, dynamic_ncols=True))


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _first_rank(rank: int | None) -> bool:
    if rank is not None:
        return rank == 0
    dist = sys.modules.get("torch.distributed")  # never imported here: only a job has one up
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return True
    return bool(dist.get_rank() == 0)
