"""A checkpoint read from snapshots kept in this node's shared memory: the ``memory`` source.

It presents the files a kept snapshot holds (``record``) as the ``Source`` of the read side
(``_read.sources``): the skeleton from the record, each shard as its header followed by its
data in the slab. In a multi-rank job it presents the files of every rank whose snapshot of
the step is kept on this node; a file of a rank kept elsewhere is missing, and the restore
reads that step from storage instead. Nothing it returns is trusted: the readers check every
size and every byte against the manifest (``_read.verified``) as they do for storage.

A file whose checksum its record does not have yet (a pending record: ``record``) is checked
against nothing but itself: the restore's hash of it is learnt (``learn``) and completes the
record (``Keeper.settle``); nothing writes a kept slab while its record exists.

Bytes are copied by the kernel (``Found.read_into``: ``preadv`` of the data file, the GIL
released), so the read side's threads copy in parallel as they do from a file in the page cache.
"""

from __future__ import annotations

from collections.abc import Sequence

from mpckpt._keep.record import UNKNOWN, Span
from mpckpt._keep.store import Found
from mpckpt.errors import CheckpointNotFoundError, CorruptCheckpointError
from mpckpt.format.manifest import Manifest
from mpckpt.format.names import checkpoint_name


class MemorySource:
    """The files of step ``manifest.step`` in the kept snapshots ``found`` (one per rank here)."""

    kind = "memory"

    def __init__(self, found: Sequence[Found], manifest: Manifest) -> None:
        self.name = checkpoint_name(manifest.step)
        self.manifest = manifest
        self.learned: dict[str, str] = {}  # checksums of pending files, as the restore computed them
        self._files: dict[str, tuple[Found, Span | bytes]] = {}
        for f in found:
            for rel, span in f.record.spans.items():
                self._files[rel] = (f, span)
            for rel, data in f.record.small.items():
                self._files[rel] = (f, data)

    def learn(self, relpath: str, digest: str) -> bool:
        """The checksum the restore computed of every byte of ``relpath``, which the manifest could
        not give (its kept record was pending: its process died before the checksums were in it):
        taken as the file's (True) when that is so; False for any other file."""
        held = self._files.get(relpath)
        if held is None or not isinstance(held[1], Span) or held[1].checksum is not None:
            return False
        if self.manifest.files[relpath].checksum != UNKNOWN:
            return False
        self.learned[relpath] = digest
        return True

    def location(self, relpath: str) -> str:
        held = self._files.get(relpath)
        return f"{held[0].path} ({relpath})" if held is not None else f"memory ({relpath})"

    def size(self, relpath: str) -> int:
        held = self._files.get(relpath)
        if held is None:
            raise CheckpointNotFoundError(f"{relpath} of {self.name} is not kept in this node's memory")
        what = held[1]
        return what.size if isinstance(what, Span) else len(what)

    def read_into(self, relpath: str, offset: int, out: memoryview) -> None:
        held = self._files.get(relpath)
        if held is None:
            raise CheckpointNotFoundError(f"{relpath} of {self.name} is not kept in this node's memory")
        found, what = held
        end = offset + len(out)
        if offset < 0 or end > self.size(relpath):
            raise CorruptCheckpointError(f"{self.location(relpath)}: a read of [{offset}, {end}) lies past its end",
                                         path=self.location(relpath))
        if isinstance(what, bytes):
            out[:] = what[offset:end]
            return
        head = what.header
        at = 0
        if offset < len(head):  # the header part
            n = min(len(head), end) - offset
            out[:n] = head[offset:offset + n]
            at, offset = n, len(head)
        n = len(out) - at
        if n <= 0:
            return
        found.read_into(what.offset + offset - len(head), out[at:])  # (preadv: releases the GIL)
