"""Frozen shards: written once into ``shared/``, then referenced while their tensors do not change.

Parameters with ``requires_grad=False`` (a frozen backbone, embeddings) get shard files of
their own (``layout``). Such a file is written into ``shared/`` under a name never used
before (``format.names.shared_path``), not into the checkpoint's folder, and the manifest
lists it there (``FileEntry.shared``). When a later save finds every tensor of the shard
unchanged (same storage address, same in-place version counter), its manifest lists the
same shared file instead of writing it again. A shared file belongs to no checkpoint: it
lives as long as any committed or pending checkpoint lists it, so deleting any one
checkpoint (retention, ``ckpt.delete``, ``mpckpt rm``, or ``rm -rf`` of its folder) never
breaks another.

INVARIANT: only committed files are ever referenced: a shard becomes known after the commit
of the checkpoint that wrote it, and is forgotten (``let_go``) in the same step, under the
same lock, as it is found unreferenced and handed over for deletion; a save looks up and
lists what it references under that lock too, so a file is either still listed by a pending
save or never referenced again before it is deleted.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable

from mpckpt._codec.snapshot import FlatState
from mpckpt._ledger import Ledger, Pending
from mpckpt._stage.layout import Layout
from mpckpt.format.manifest import FileEntry, Manifest
from mpckpt.format.names import shared_path

Versions = tuple[tuple[int, int], ...]


@dataclasses.dataclass
class Reuse:
    """Shard files of this save that are referenced, not written; the leaves they hold; where
    the frozen shards it writes go (``shared/``)."""

    files: dict[str, FileEntry] = dataclasses.field(default_factory=dict)
    leaves: set[int] = dataclasses.field(default_factory=set)
    shared: dict[str, str] = dataclasses.field(default_factory=dict)

    def needs_copy(self, leaf: int) -> bool:
        return leaf not in self.leaves

    def target(self, staging: str, filename: str) -> str:
        """Where the job writing ``filename`` writes it: ``shared/`` for a frozen shard."""
        return self.shared.get(filename) or f"{staging}/{filename}"


class FrozenShards:
    """The committed shared files of frozen tensors, by layout and file name."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self._lock = threading.Lock()
        # (layout key, shard file) -> (versions of its frozen tensors, its committed entry)
        self._known: dict[tuple[int, str], tuple[Versions, FileEntry]] = {}

    def forget_folder(self, name: str) -> None:
        """``name`` is being deleted: never reference files in it again (entries of older formats)."""
        with self._lock:
            self._known = {k: v for k, v in self._known.items() if v[1].ref != name}

    def let_go(self, deleted: Iterable[Manifest]) -> list[str]:
        """The shared files of ``deleted`` (checkpoints already forgotten by the ledger) that no
        committed or pending checkpoint lists any more: never referenced again; delete them."""
        candidates = {p for m in deleted for p in m.shared_files()}
        if not candidates:
            return []
        with self._lock:
            gone = candidates - self.ledger.referenced_shared()
            self._known = {k: v for k, v in self._known.items() if v[1].shared not in gone}
        return sorted(gone)

    def reuse_unchanged(self, record: Pending, flat: FlatState, layout: Layout) -> Reuse:
        """Reference the frozen shards whose tensors did not change since a committed save."""
        reuse = Reuse()
        written: dict[str, Versions] = {}
        with self._lock:  # INVARIANT: what is looked up is listed by the record before let_go can run
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
                        reuse.shared[shard.filename] = shared_path(record.step, shard.filename)
            self.ledger.add_files(record, reuse.files)
        self.ledger.add_shared(record, reuse.shared)
        if written:
            def remember() -> None:  # only committed files may ever be referenced
                with self._lock:
                    for filename, versions in written.items():
                        self._known[(layout.key, filename)] = (versions, record.files[filename])
            self.ledger.after_commit(record, remember)
        return reuse
