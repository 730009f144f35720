"""Deleting checkpoints retention let go of, on a thread of its own.

The committer decides what to delete and forgets it at once (nothing lists or references it
again); the ``Deleter`` then removes the folders in the background, oldest first, so a slow
delete on an object store (one request per file) never holds up the next commit. Deleting
removes the manifest first (``Backend.delete``), so a reader never finds a half-deleted
checkpoint that still looks committed.

Each hand-over is a batch: checkpoint folders, then the shared files that no checkpoint
lists once they are gone. INVARIANT: a batch's shared files are deleted only after every
folder of the batch was deleted: a checkpoint that is still listed never loses a file.

A failed delete is logged as a warning naming the folder and left for ``mpckpt gc``: the
checkpoint was already forgotten, and what is left of it is never mistaken for a commit
(``gc`` removes manifest-less folders, and shared files no manifest lists; the next open
does too). ``drain`` and ``close`` wait a bounded time.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

from mpckpt._threads import Thread
from mpckpt.errors import MpckptError, WaitTimeoutError
from mpckpt.storage import Backend

log = logging.getLogger("mpckpt")


class Deleter:
    """Removes checkpoint folders in the background, in the order they were handed over."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._queue: collections.deque[tuple[list[str], list[str]]] = collections.deque()
        self._busy = False
        self._stopping = False
        self._cond = threading.Condition()
        self._thread = Thread(target=self._run, name="mpckpt-deleter", daemon=True)
        self._thread.start()

    def delete(self, names: list[str], *, shared: list[str] | None = None) -> None:
        """Delete checkpoint folders ``names`` (in this order), then the ``shared`` files."""
        if not names and not shared:
            return
        with self._cond:
            self._queue.append((list(names), list(shared or ())))
            self._cond.notify_all()

    def drain(self, *, timeout_s: float) -> None:
        """Wait until every folder handed over so far is deleted (or its failure logged)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WaitTimeoutError(f"deleting old checkpoints in {self.backend.url} took more than "
                                           f"{timeout_s:.0f}s; {len(self._queue)} still queued")
                self._cond.wait(min(left, 1.0))

    def close(self, *, timeout_s: float) -> None:
        """Finish what is queued (bounded by ``timeout_s``) and stop."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("mpckpt: still deleting old checkpoints in %s after %.0fs; `mpckpt gc` removes "
                        "what is left", self.backend.url, timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:
                    return
                names, shared = self._queue.popleft()
                self._busy = True
            try:
                # INVARIANT: shared files only once every folder listing them is gone
                if all(self._quietly(self.backend.delete, name) for name in names):
                    for path in shared:
                        self._quietly(self.backend.delete_file, path)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _quietly(self, delete: Callable[[str], None], name: str) -> bool:
        """Delete one folder or file; a failure is logged (``mpckpt gc`` removes what is left)."""
        try:
            delete(name)
            return True
        except (MpckptError, OSError) as e:
            log.warning("mpckpt: could not delete %s in %s: %s; `mpckpt gc` removes what is left", name,
                        self.backend.url, e)
        except Exception as e:  # a bug: logged with its traceback, deletions go on
            log.error("mpckpt: deleting %s in %s: %s: %s", name, self.backend.url, type(e).__name__, e, exc_info=e)
        return False
