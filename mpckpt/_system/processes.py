"""What mpckpt's processes share, whichever side started them: a failure carried back from
another process (``RemoteFailure``), the title ps/top shows (``set_title``), Linux's ``prctl``,
and whether a process is alive. No torch: the uploader processes import it.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import traceback
from dataclasses import dataclass
from typing import Any

from mpckpt.errors import add_note


@dataclass
class RemoteFailure:
    """An exception from another process of mpckpt's: the original if it pickles, else its type name and text."""

    exc: BaseException | None
    type_name: str
    message: str
    remote_traceback: str

    @classmethod
    def capture(cls, e: BaseException) -> RemoteFailure:
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        exc: BaseException | None = e
        try:
            pickle.loads(pickle.dumps(e))
        except Exception:
            exc = None
        return cls(exc, f"{type(e).__module__}.{type(e).__qualname__}", str(e), tb)

    def rebuild(self) -> BaseException:
        exc = self.exc if self.exc is not None else RuntimeError(f"{self.type_name}: {self.message}")
        exc.__traceback__ = None
        add_note(exc, f"raised in an mpckpt uploader process:\n{self.remote_traceback.rstrip()}")
        return exc


def prctl(option: int, arg: Any) -> None:
    """Linux's ``prctl(option, arg)`` for the calling process; nothing elsewhere."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(option, arg, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: nothing to set
        pass


def set_title(title: str) -> None:
    """Show ``title`` in ps/top: the whole command line where setproctitle is installed,
    and the kernel's 15-character thread name (PR_SET_NAME) in any case."""
    try:
        import setproctitle
    except ImportError:
        pass
    else:
        setproctitle.setproctitle(title)
    prctl(15, ctypes.c_char_p(title.replace(" ", "-").encode()[:15]))  # PR_SET_NAME


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (uploaders and the validator watch their trainer with it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
