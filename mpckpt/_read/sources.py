"""Where the bytes of a committed checkpoint come from: the ``Source`` seam of the read side.

Every reader (``whole``, ``regions``) reads a checkpoint's files through a ``Source``: the
size of a file and a ranged read into memory the caller owns. What a source returns is never
trusted: the readers check every size against the manifest and every byte against its
checksum (``verified``), whichever source it came from.

``StorageSource`` reads a checkpoint from its root (a local path, fsspec, Azure). The recovery
tier adds sources of its own (a snapshot kept in this node's shared memory, a copy in a peer's
memory): a restore tries the sources of a step in the order ``ORDER`` gives (nearest first)
with ``first_that_reads``, and goes on to the next source when one is missing or damaged, so
a damaged copy in memory costs a read from storage, never a wrong byte.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from mpckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, StateError
from mpckpt.format.manifest import Manifest
from mpckpt.storage import Backend

log = logging.getLogger("mpckpt")
T = TypeVar("T")

ORDER = ("memory", "peer", "storage")  # nearest first: this node's memory, a peer's memory, the root


class Source(Protocol):
    """The files of one committed checkpoint, as one place holds them."""

    kind: str          # one of ``ORDER``: what a restore says it restored from
    name: str          # the checkpoint's folder name (``step_0000000042``)
    manifest: Manifest  # what every size and checksum is checked against

    def location(self, relpath: str) -> str:
        """How errors name file ``relpath`` (a path under the root, or the source's own)."""
        ...

    def size(self, relpath: str) -> int:
        """The size of file ``relpath`` there; ``CheckpointNotFoundError`` when it is missing."""
        ...

    def read_into(self, relpath: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with bytes ``[offset, offset + len(out))`` of file ``relpath``."""
        ...


class StorageSource:
    """A checkpoint's files in its root (``Backend``): the source every checkpoint has."""

    kind = "storage"

    def __init__(self, backend: Backend, name: str, manifest: Manifest) -> None:
        self.backend, self.name, self.manifest = backend, name, manifest
        self._locations: dict[str, str] = {}

    def location(self, relpath: str) -> str:
        where = self._locations.get(relpath)
        if where is None:
            where = self._locations[relpath] = self.manifest.location(self.name, relpath)
        return where

    def size(self, relpath: str) -> int:
        return self.backend.size(self.location(relpath))

    def read_into(self, relpath: str, offset: int, out: memoryview) -> None:
        self.backend.read_into(self.location(relpath), offset, out)


def in_order(sources: Sequence[Source]) -> list[Source]:
    """``sources`` nearest first (``ORDER``); sources of one kind keep their order."""
    return sorted(sources, key=lambda s: ORDER.index(s.kind))


def first_that_reads(sources: Sequence[Source], read: Callable[[Source], T]) -> tuple[Source, T]:
    """``read`` from the nearest source that has the checkpoint intact: ``(source, result)``.

    A source whose files are missing or do not verify is logged and the next one is tried;
    when none reads, the last one's error is raised (storage, the source of record, comes last).
    """
    ordered = in_order(sources)
    if not ordered:
        raise CheckpointNotFoundError("no source holds this checkpoint")
    for source in ordered[:-1]:
        try:
            return source, read(source)
        except Exception as e:  # a copy nearer than the source of record that does not read: the next one
            if not isinstance(e, (CorruptCheckpointError, CheckpointNotFoundError, OSError, StateError)):
                log.error("mpckpt: reading %s from %s failed unexpectedly", source.name, source.kind, exc_info=e)
            if isinstance(e, StateError):  # the state does not match the checkpoint: no other copy will
                raise
            log.warning("mpckpt: %s cannot be read from %s (%s); trying %s", source.name, source.kind, e,
                        ordered[ordered.index(source) + 1].kind)
    last = ordered[-1]
    return last, read(last)
