"""What is committed under a root: the recovery scan and the queries over committed checkpoints.

``scan`` reads every checkpoint folder's manifest: folders with a valid manifest are the
committed checkpoints; folders of ours without one are debris of a crash, deleted (with
``clean``) unless a committed checkpoint references files in them; a folder whose manifest
cannot be read is reported and kept, never deleted (it may be recoverable). One bad folder
never stops the scan, and only names mpckpt writes count.

``recover`` is what opening a root for writing does, once, in one place: a ``Checkpointer``
and ``mpckpt gc`` both call it (with the writer lock held). It also deletes the files in
``shared/`` that no manifest lists (a crashed save's, or those of checkpoints deleted by hand:
``_commit.shared``). ``Catalog`` answers the queries
over committed checkpoints (steps, latest, best, one manifest) for a live ``Checkpointer``
(over its ledger's view) and for the command line (over a scan). Reading a checkpoint is the
read side's (``_read``; ``mpckpt.load`` is ``_view.load``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from mpckpt._commit.shared import collect_orphans
from mpckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, MpckptError
from mpckpt.format import validation
from mpckpt.format.manifest import MAX_MANIFEST_BYTES, Manifest
from mpckpt.format.names import MANIFEST_NAME, checkpoint_name, step_of
from mpckpt.storage import Backend

log = logging.getLogger("mpckpt")
_LOAD_ATTEMPTS = 8


def scan(backend: Backend, *, clean: bool, problems: dict[int, Exception] | None = None) -> dict[int, Manifest]:
    """Committed checkpoints by step; with ``clean``, delete manifest-less checkpoint folders.

    One bad folder never stops the rest: a folder whose manifest cannot be read or does not
    verify (damaged, hostile, a link, a FIFO, another step's) is reported in ``problems`` and
    skipped, never deleted. Only folders under names mpckpt writes count, and a manifest-less
    folder is deleted only if no valid manifest references files in it.
    """
    found: dict[int, Manifest] = {}
    incomplete: list[str] = []
    for name in backend.list_names():
        step = step_of(name)
        if step is None:
            continue
        try:
            manifest = read_manifest(backend, name)
        except CheckpointNotFoundError:
            incomplete.append(name)
            continue
        except MpckptError as e:
            log.warning("mpckpt: skipping %s: %s", name, e)
            if problems is not None:
                problems[step] = e
            continue
        found[step] = manifest
    if clean and incomplete:
        referenced = {e.ref for m in found.values() for e in m.files.values() if e.ref}
        for name in incomplete:
            if name in referenced:
                log.warning("mpckpt: %s has no manifest but committed checkpoints use its files; kept", name)
                continue
            log.info("mpckpt: removing incomplete checkpoint folder %s", name)
            backend.delete(name)
    return found


def read_manifest(backend: Backend, name: str) -> Manifest:
    """The verified manifest of checkpoint folder ``name``; ``CheckpointNotFoundError`` if it has none.

    The metrics of its ``validation.json`` (``validate=``), if any, are joined into its metrics.
    """
    path = f"{name}/{MANIFEST_NAME}"
    manifest = Manifest.from_bytes(backend.read_bytes(path, max_bytes=MAX_MANIFEST_BYTES), path=path)
    if checkpoint_name(manifest.step) != name:
        raise CorruptCheckpointError(f"{path}: the manifest is of step {manifest.step}, not of its folder {name}; "
                                     "a folder copied or renamed by hand is not loaded", path=path)
    return validation.joined(manifest, validation.read(backend, name, manifest))


@dataclass
class Recovered:
    """What ``recover`` found and did."""

    committed: dict[int, Manifest]
    damaged: dict[int, Exception] = field(default_factory=dict)  # never deleted, never saved over
    removed_staging: list[str] = field(default_factory=list)
    removed_incomplete: list[str] = field(default_factory=list)
    removed_shared: list[str] = field(default_factory=list)  # shared files no manifest lists


def recover(backend: Backend) -> Recovered:
    """Clean up after a crashed writer and read what is committed (call with the writer lock held)."""
    staging = backend.cleanup_incomplete()
    before = set(backend.list_names())
    damaged: dict[int, Exception] = {}
    committed = scan(backend, clean=True, problems=damaged)
    removed = sorted(before - set(backend.list_names()))
    shared = collect_orphans(backend, committed, damaged)  # after the scan: manifest-less folders list none
    return Recovered(committed, damaged, list(staging), removed, shared)


class Catalog:
    """Queries over committed checkpoints (``step -> manifest``)."""

    def __init__(self, committed: Mapping[int, Manifest]) -> None:
        self.committed = dict(committed)

    def steps(self) -> list[int]:
        """Committed steps, oldest first."""
        return sorted(self.committed)

    @property
    def latest_step(self) -> int | None:
        return max(self.committed, default=None)

    def best(self, n: int, metric: str, mode: str) -> list[int]:
        """The ``n`` steps with the best ``metric`` (``mode`` 'min' or 'max'; NaN never wins)."""
        from mpckpt.policies.retention import rank_by_metric

        records = sorted(self.committed.items())
        return [records[i][0] for i in rank_by_metric(records, metric, mode)[:n]]

    def manifest(self, step: int | None, where: str) -> Manifest:
        """The manifest of ``step`` (default: the latest), or ``CheckpointNotFoundError``."""
        step = self.latest_step if step is None else step
        manifest = self.committed.get(step) if step is not None else None
        if manifest is None:
            raise CheckpointNotFoundError(f"no committed checkpoint of step {step} in {where}")
        return manifest
