"""The steps this process is reading (``load``, ``restore``, an integration's ``holding``), which
retention keeps while they are read.

A step enters under the committer's retention lock, so a retention decision either sees it as
read or has forgotten it already (the reader's lookup then says it is gone; nothing is half
read). When its last reader lets go, retention is applied again: a commit meanwhile may have
left it only because it was read, and no later commit may come to let it go.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable, Iterator


class Readers:
    """Counts the readers of each step (``reading``: with the committer's retention lock and its reapply)."""

    def __init__(self) -> None:
        self._count: collections.Counter[int] = collections.Counter()
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def reading(self, step: int, retention_lock: threading.Lock,
                reapply: Callable[[int], None]) -> Iterator[None]:
        with retention_lock, self._lock:
            self._count[step] += 1
        try:
            yield
        finally:
            with self._lock:
                self._count[step] -= 1
                last = not self._count[step]
                if last:
                    del self._count[step]
            if last:
                reapply(step)

    def steps(self) -> set[int]:
        with self._lock:
            return set(self._count)
