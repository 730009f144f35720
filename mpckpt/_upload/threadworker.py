"""A worker thread standing in for an uploader process, for storage that lives in this process
(fsspec ``memory://``): the pool (``pool``) drives it as it drives a process."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

from mpckpt._threads import Thread


class ThreadWorker:
    """A worker thread standing in for a process, for storage that lives in this process.

    It speaks the same pipe protocol and offers what the dispatcher uses of a process: a
    sentinel (a pipe that becomes readable when the thread ends), ``exitcode``, ``join``.
    """

    def __init__(self, target: Callable[..., None], args: tuple[Any, ...]) -> None:
        self.sentinel, self._done_w = os.pipe()
        self.pid = os.getpid()
        self.exitcode: int | None = None
        self._thread = Thread(target=self._main, args=(target, args), name="mpckpt-uploader", daemon=True)

    def _main(self, target: Callable[..., None], args: tuple[Any, ...]) -> None:
        try:
            target(*args)
            self.exitcode = 0
        except BaseException:
            self.exitcode = 1
        finally:
            os.close(self._done_w)

    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)
        if not self._thread.is_alive():
            with contextlib.suppress(OSError):
                os.close(self.sentinel)

    def kill(self) -> None:
        """Threads cannot be killed; closing the pipe (done by the pool) ends the loop."""

