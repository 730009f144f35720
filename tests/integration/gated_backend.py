"""A real local backend whose shard writes wait at a gate: a file that the test creates.

Registered under ``gated://`` so the uploader processes build the same subclass. Every write
of a file whose path matches the storage option ``hold`` (default: shard files) waits until
the file named by the option ``gate`` exists, so a test decides exactly when uploads may
finish: saves taken before it opens the gate all pile up, taken and not yet durable. Nothing
else is held (the probe at open, the skeleton, the manifest).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

from mpckpt.storage import BackendSpec, register_backend
from mpckpt.storage.local import LocalBackend
from tests.waiting import poll_until

SCHEME = "gated"
_POLL_S = 0.02


class GatedLocal(LocalBackend):
    def __init__(self, root: str, options: dict[str, Any]) -> None:
        super().__init__(root, options)
        self.options = options

    @classmethod
    def from_spec(cls, spec: BackendSpec) -> GatedLocal:
        return cls(spec.root.split("://", 1)[1], spec.options)

    def spec(self) -> BackendSpec:
        return BackendSpec(SCHEME, f"{SCHEME}://{self.root}", self.options, factory=f"{__name__}:GatedLocal.from_spec")

    def write_file(self, relpath: str, parts: Sequence[Any]) -> None:
        if re.search(self.options.get("hold", r"\.safetensors$"), relpath):
            gate = self.options["gate"]  # never a hang: past the bound the write goes on and the test fails instead
            poll_until(lambda: os.path.exists(gate), float(self.options.get("max_wait_s", 120)), poll_s=_POLL_S)
        super().write_file(relpath, parts)


register_backend(SCHEME, f"{__name__}:GatedLocal.from_spec")


def gated_url(path: os.PathLike[str] | str) -> str:
    return f"{SCHEME}://{os.fspath(path)}"
