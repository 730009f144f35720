"""What every command of ``mpckpt`` shares: escaped output, opening a root, the exit status.

INVARIANT: everything a command prints goes through ``say`` or ``complain`` (the library's
log records too, through ``PrintableLog``), which escape control characters: file names,
metrics and error messages quoting them come from storage, and a hostile manifest must not
drive the terminal. A command returns 0 or 1; ``exit_status`` turns an ``MpckptError`` into
a one-line message and 1, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from mpckpt.catalog import scan
from mpckpt.errors import ConfigError, MpckptError
from mpckpt.format.manifest import Manifest
from mpckpt.storage import open_backend, spec_for_url


def printable(text: object) -> str:
    """``text`` with control characters (C0, DEL, C1) shown as escapes, never sent raw."""
    return "".join(c if c.isprintable() or c == " " else ascii(c)[1:-1] for c in str(text))


def say(text: object) -> None:
    print(printable(text))


def complain(text: object) -> None:
    print(printable(text), file=sys.stderr)


class PrintableLog(logging.Handler):
    """The library's log records, escaped like everything else this command prints."""

    def emit(self, record: logging.LogRecord) -> None:
        complain(f"mpckpt: {record.getMessage()}")


def route_library_log() -> None:
    """Send the library's errors through ``complain``; the commands report warnings themselves."""
    logger = logging.getLogger("mpckpt")
    if not logger.handlers:  # the command reports what the scan would warn about itself
        logger.addHandler(PrintableLog())
        logger.setLevel(logging.ERROR)
        logger.propagate = False


def exit_status(command: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run ``command``: its status, or 1 with the error on stderr when it raises ``MpckptError``."""
    try:
        return int(command(args))
    except MpckptError as e:
        complain(f"mpckpt: {e}")
        return 1


def backend_for(root: str, options: str | None) -> Any:
    """The backend of ``root``; ``options`` is the ``--storage-options`` JSON text, if any."""
    try:
        parsed = json.loads(options) if options else None
    except ValueError as e:
        raise ConfigError(f"--storage-options is not a JSON object ({e})") from e
    spec = spec_for_url(root, parsed)
    if spec.scheme == "file" and not os.path.isdir(spec.root):
        raise ConfigError(f"{spec.root} does not exist; give the folder a Checkpointer wrote to")
    return open_backend(spec)


def scan_root(backend: Any, *, clean: bool = False) -> tuple[dict[int, Manifest], dict[int, Exception]]:
    """The committed checkpoints of ``backend`` by step, and the steps whose folder is damaged."""
    problems: dict[int, Exception] = {}
    return scan(backend, clean=clean, problems=problems), problems
