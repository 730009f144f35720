"""Frozen shards: files of unchanged frozen tensors are referenced, not written again.

Parameters with ``requires_grad=False`` (a frozen backbone, embeddings) get shard files of
their own (``layout``). When a later save finds every tensor of such a shard unchanged (same
storage address, same in-place version counter), its manifest references the file in the
checkpoint that wrote it (``FileEntry.ref``) instead of writing it again.

INVARIANT: only committed files are ever referenced: a shard becomes known after the commit
of the checkpoint that wrote it, and is forgotten when retention deletes that checkpoint;
the committer never deletes a folder a committed or pending checkpoint references.
"""

from __future__ import annotations

import dataclasses

from mpckpt._commit.ledger import Ledger, Pending
from mpckpt._stage.layout import Layout
from mpckpt._stage.snapshot import FlatState
from mpckpt.format.manifest import FileEntry

Versions = tuple[tuple[int, int], ...]


@dataclasses.dataclass
class Reuse:
    """Shard files of this save that are referenced, not written, and the leaves they hold."""

    files: dict[str, FileEntry] = dataclasses.field(default_factory=dict)
    leaves: set[int] = dataclasses.field(default_factory=set)

    def needs_copy(self, leaf: int) -> bool:
        return leaf not in self.leaves


class FrozenShards:
    """The committed shard files of frozen tensors, by layout and file name."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        # (layout key, shard file) -> (versions of its frozen tensors, where the file is committed)
        self._known: dict[tuple[int, str], tuple[Versions, FileEntry]] = {}

    def forget_folder(self, name: str) -> None:
        """``name`` is being deleted: never reference files in it again."""
        self._known = {k: v for k, v in self._known.items() if v[1].ref != name}

    def reuse_unchanged(self, record: Pending, flat: FlatState, layout: Layout) -> Reuse:
        """Reference the frozen shards whose tensors did not change since a committed save."""
        reuse = Reuse()
        written: dict[str, Versions] = {}
        for wave in layout.waves:
            for shard in wave.shards:
                if not shard.frozen:
                    continue
                versions = flat.versions(sorted({p.leaf for p in shard.pieces}))
                known = self._known.get((layout.key, shard.filename))
                if known is not None and known[0] == versions:
                    reuse.files[shard.filename] = known[1]
                    reuse.leaves.update(p.leaf for p in shard.pieces)
                else:
                    written[shard.filename] = versions
        self.ledger.add_files(record, reuse.files)
        if written:
            def remember() -> None:  # only committed files may ever be referenced
                for filename, versions in written.items():
                    e = record.files[filename]
                    self._known[(layout.key, filename)] = (versions, FileEntry(e.size, e.checksum, ref=record.name))
            self.ledger.after_commit(record, remember)
        return reuse
