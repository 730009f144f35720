"""The one place background failures come out of: each is raised exactly once.

Failures happen where nobody is waiting: an upload in an uploader process, a commit on the
committer thread, a pool callback that raised on the dispatcher thread. Each lands on the
``SaveFuture`` of its checkpoint, or (a bug in a callback, which belongs to no checkpoint) in
a source the sink polls. ``raise_unseen`` is called at every ``save``, ``report``, ``wait``,
while a save waits for memory, and at close: it raises the first failure nobody has seen,
with the others attached as notes, and marks them all seen. A failure the caller already
got (from ``result()``, ``exception()`` or the call that raised it) is never raised again.

INVARIANT: no background failure is dropped: if nobody is left to raise it to (a finalizer,
the end of the program), ``take_unseen`` hands it to the caller to log.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from mpckpt._futures import SaveFuture
from mpckpt.errors import add_note


class ErrorSink:
    """Futures of checkpoints in flight, and polled sources of failures that belong to none."""

    def __init__(self) -> None:
        self._futures: list[SaveFuture] = []
        self._sources: list[Callable[[], BaseException | None]] = []
        self._lock = threading.Lock()

    def watch(self, future: SaveFuture) -> None:
        """Raise ``future``'s failure at the next check unless the caller looks at it first."""
        with self._lock:
            self._futures.append(future)

    def add_source(self, take: Callable[[], BaseException | None]) -> None:
        """``take()`` returns one new failure (and forgets it), or None."""
        self._sources.append(take)

    def take_unseen(self) -> list[BaseException]:
        """Every failure nobody has seen yet; each is returned once."""
        errors: list[BaseException] = []
        for take in self._sources:
            while (error := take()) is not None:
                errors.append(error)
        with self._lock:
            futures, self._futures = self._futures, [f for f in self._futures if not f.done()]
        for future in futures:
            error = future._unseen_exception()
            if error is not None:
                errors.append(error)
        return errors

    def first_unseen(self) -> BaseException | None:
        """The first unseen failure, the others noted on it (all marked seen), or None."""
        errors = self.take_unseen()
        if not errors:
            return None
        first = errors[0]
        for other in errors[1:]:
            add_note(first, f"also failed: {other}")
        return first

    def raise_unseen(self) -> None:
        """Raise the first unseen failure, the others noted on it."""
        error = self.first_unseen()
        if error is not None:
            raise error
