"""The commit seam: who publishes a checkpoint once its files are durable.

The committer builds a checkpoint's manifest from the files this process wrote and hands it
to a coordinator, which publishes it and returns the manifest as committed. In a single
process that is one ``backend.commit``: the manifest is written last, create-only. The
multi-rank coordinator (``_commit.ranked.StoreCoordinator``) plugs in here: every rank hands
over its part, the coordinating rank merges the parts into one global manifest and writes it
once all are durable, and every rank learns the outcome. A rank whose save failed or was
dropped says so (``abandon``), so the others are not left waiting; removing a failed
checkpoint's files is the coordinator's (``abort``: in a multi-rank job they are every rank's).

``world_size`` goes into every manifest, so a reader knows how many ranks wrote it.
"""

from __future__ import annotations

from typing import Protocol

from mpckpt.format.manifest import Manifest
from mpckpt.storage import Backend


class StepDropped(Exception):
    """Raised by ``Coordinator.commit``: another rank dropped this step (its memory budget was
    full under ``policy='skip'``, or it coalesced the step away), so no rank commits it; like
    a skipped save, it resolves with no checkpoint and is not an error."""


class Coordinator(Protocol):
    """Publishes checkpoints whose files are durable."""

    rank: int
    world_size: int

    def commit(self, staging: str, name: str, manifest: Manifest) -> Manifest:
        """Publish ``staging`` as checkpoint ``name``; return the manifest as committed."""
        ...

    def abandon(self, step: int, staging: str, status: str, reason: str) -> None:
        """This process has nothing to commit for ``step`` (``status``: failed or dropped)."""
        ...

    def abort(self, staging: str) -> None:
        """Remove what a failed checkpoint wrote under ``staging``."""
        ...


class SingleProcess:
    """The coordinator of a checkpointer that is the only writer of its checkpoints."""

    rank = 0
    world_size = 1

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def commit(self, staging: str, name: str, manifest: Manifest) -> Manifest:
        self.backend.commit(staging, name, manifest.to_bytes())
        return manifest

    def abandon(self, step: int, staging: str, status: str, reason: str) -> None:
        pass  # nobody else waits for it

    def abort(self, staging: str) -> None:
        self.backend.abort(staging)
