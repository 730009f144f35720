"""Real backend subclasses for fault injection: local disk with delays and failures by rule.

Registered under the ``ctl://`` scheme so uploader processes build the same subclass. Rules
come from storage options, each keyed by a regular expression searched in the written path
(the local staging folder is ``.tmp.step_0000000002.<pid>.<token>/``): ``delay`` maps it to
seconds, ``fail`` to an error message (an OSError is raised), ``fail_once`` fails only the
first attempt (a marker file under ``marker_dir`` remembers), ``kill_worker`` (a list) makes
the uploader process SIGKILL itself while writing a matching path, once;
``slow_file`` names a file whose content is a number of seconds added to every file written
while it exists (a slow disk that a test turns on and off); ``writable_only_in_pid`` refuses writes (at ``check_writable``) in every other process, as
storage that the training process may write to but its uploaders may not.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Sequence
from typing import Any

from mpckpt.errors import ConfigError
from mpckpt.storage import BackendSpec, register_backend
from mpckpt.storage.local import LocalBackend

SCHEME = "ctl"


class ControlledLocal(LocalBackend):
    def __init__(self, root: str, options: dict[str, Any]) -> None:
        super().__init__(root, options)  # reads direct_io; the rules are read below
        self.options = options

    @classmethod
    def from_spec(cls, spec: BackendSpec) -> ControlledLocal:
        return cls(spec.root.split("://", 1)[1], spec.options)

    def spec(self) -> BackendSpec:
        return BackendSpec(SCHEME, f"{SCHEME}://{self.root}", self.options, factory=f"{__name__}:ControlledLocal.from_spec")

    def _once(self, key: str) -> bool:
        marker = os.path.join(self.options["marker_dir"], key.replace("/", "_"))
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        os.close(fd)
        return True

    def _apply_rules(self, relpath: str) -> None:
        if (slow := self.options.get("slow_file")) is not None:
            try:
                with open(slow) as f:
                    time.sleep(min(60.0, float(f.read() or 0)))  # the rule's scenario: a slow disk
            except (OSError, ValueError):
                pass  # no file (the disk is fast again), or a half-written one
        for pattern, seconds in self.options.get("delay", {}).items():
            if re.search(pattern, relpath):
                time.sleep(seconds)  # the rule's scenario: a slow write
        for pattern, message in self.options.get("fail", {}).items():
            if re.search(pattern, relpath):
                raise OSError(5, message)
        for pattern, message in self.options.get("fail_once", {}).items():
            if re.search(pattern, relpath) and self._once("fail_once" + relpath):
                raise OSError(5, message)
        for pattern in self.options.get("kill_worker", []):
            if re.search(pattern, relpath) and self._once("kill" + relpath):
                os.kill(os.getpid(), signal.SIGKILL)

    def check_writable(self) -> None:
        only = self.options.get("writable_only_in_pid")
        if only is not None and os.getpid() != only:
            raise ConfigError(f"{self.url}: permission denied for process {os.getpid()} (rule writable_only_in_pid)")
        super().check_writable()

    def write_file(self, relpath: str, parts: Sequence[Any]) -> None:
        self._apply_rules(relpath)
        super().write_file(relpath, parts)

    def upload_file(self, relpath: str, local_path: str) -> None:
        self._apply_rules(relpath)
        super().upload_file(relpath, local_path)


register_backend(SCHEME, f"{__name__}:ControlledLocal.from_spec")


def ctl_url(path: os.PathLike[str] | str) -> str:
    return f"{SCHEME}://{os.fspath(path)}"
