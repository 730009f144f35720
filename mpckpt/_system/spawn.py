"""How uploader processes start: from a fork server, without the user's main module.

The ``forkserver`` and ``spawn`` start methods normally re-import the parent's ``__main__``
in every child (and ``forkserver`` also in the server itself) so that functions defined in
the main script can be unpickled there. Uploaders need nothing from the main script: their
entry point is ``mpckpt._upload.worker.worker_main`` and everything they receive is a plain
dataclass. Importing the script anyway is what broke three kinds of users:

* a script without ``if __name__ == "__main__":`` ran its whole training loop again inside
  the fork server (which then failed on the writer lock, with a confusing error);
* a script read from standard input (``python - < train.py``) failed, because
  ``<stdin>`` is not a file the child can import;
* every uploader paid for the imports of the user's script (torch, the model code).

So for processes named ``mpckpt-uploader`` (and the ``mpckpt-validator`` that runs
``validate=``, whose function travels by value: ``_commit/validator_process.py``) the
preparation data sent to the child leaves the main module out, and the fork server preloads
``mpckpt._upload.server`` (the worker module, and ignoring the job signals a scheduler sends
to the whole group) instead of ``__main__``. Other
processes started with ``multiprocess`` in the same program keep their main module.

What the uploaders do get from the training process is its environment *at the time the
Checkpointer opens* (``worker_main`` applies it): the fork server is started once per
process and would otherwise hand every later uploader the environment of that moment.

The fork server listens on a Unix socket in a folder under the temporary directory
(``TMPDIR``), and a Unix socket's path holds at most 107 bytes: under a temporary directory too
deep for it (a CI runner's workspace, a test framework's per-test folder) the uploaders start
with ``spawn`` instead of failing to start.
"""

from __future__ import annotations

import functools
import logging
import os
import tempfile
import threading
from typing import Any

import multiprocess
import multiprocess.spawn as _mp_spawn

PROCESS_NAME = "mpckpt-uploader"
VALIDATOR_NAME = "mpckpt-validator"
_WITHOUT_MAIN = (PROCESS_NAME, VALIDATOR_NAME)
_MAIN_KEYS = ("init_main_from_name", "init_main_from_path")
_installed = threading.Lock()
_UNIX_SOCKET_PATH_MAX = 107
log = logging.getLogger("mpckpt")


def _without_main(original: Any) -> Any:
    @functools.wraps(original)
    def get_preparation_data(name: str) -> dict[str, Any]:
        data: dict[str, Any] = original(name)
        if isinstance(name, str) and name.startswith(_WITHOUT_MAIN):
            for key in _MAIN_KEYS:
                data.pop(key, None)
        return data

    get_preparation_data.__mpckpt_without_main__ = True  # type: ignore[attr-defined]
    return get_preparation_data


def _install() -> None:
    with _installed:
        current = _mp_spawn.get_preparation_data
        if not getattr(current, "__mpckpt_without_main__", False):
            _mp_spawn.get_preparation_data = _without_main(current)


def uploader_context(start_method: str) -> Any:
    """The ``multiprocess`` context uploaders start from (``fork``, ``spawn`` or ``forkserver``)."""
    _install()
    if start_method == "forkserver" and not forkserver_socket_fits():
        log.info("mpckpt: the temporary directory %s is too deep for the fork server's Unix socket; the "
                 "uploaders start with spawn", tempfile.gettempdir())
        start_method = "spawn"
    ctx = multiprocess.get_context(start_method)
    if start_method == "forkserver":
        # Only takes effect before the server starts; the server then never runs the main script.
        ctx.set_forkserver_preload(["mpckpt._upload.server"])
    return ctx


def forkserver_socket_fits(tempdir: str | None = None) -> bool:
    """Whether the fork server's socket, ``<tempdir>/pymp-<8 random>/listener-<8 random>``, fits
    in a Unix socket's path (``tempdir``: the temporary directory, ``TMPDIR`` or the system's)."""
    random8 = "0" * 8  # the random part of each name multiprocess makes: its length is what counts
    path = os.path.join(tempdir or tempfile.gettempdir(), f"pymp-{random8}", f"listener-{random8}")
    return len(os.fsencode(path)) <= _UNIX_SOCKET_PATH_MAX
