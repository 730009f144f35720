"""The commit seam: who publishes a checkpoint once its files are durable.

The committer builds a checkpoint's manifest from the files this process wrote and hands it
to a coordinator, which publishes it and returns the manifest as committed. In a single
process (the only kind today) that is one ``backend.commit``: the manifest is written last,
create-only. A multi-rank coordinator plugs in here without touching the committer: every
rank hands over its part, the coordinating rank merges the parts into one global manifest
and writes it once all are durable, and every rank learns the outcome.

``world_size`` goes into every manifest, so a reader knows how many ranks wrote it.
"""

from __future__ import annotations

from typing import Protocol

from mpckpt.format.manifest import Manifest
from mpckpt.storage import Backend


class Coordinator(Protocol):
    """Publishes checkpoints whose files are durable."""

    rank: int
    world_size: int

    def commit(self, staging: str, name: str, manifest: Manifest) -> Manifest:
        """Publish ``staging`` as checkpoint ``name``; return the manifest as committed."""
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
