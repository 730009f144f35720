"""What is committed under a root: the recovery scan, queries over committed checkpoints, load.

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
(over its ledger's view) and for the command line (over a scan). ``load`` is the reader's
entry point: no objects needed, never writes, safe beside a live writer.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mpckpt._commit.shared import collect_orphans
from mpckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, MpckptError
from mpckpt.format import validation
from mpckpt.format.manifest import MAX_MANIFEST_BYTES, Manifest
from mpckpt.format.names import MANIFEST_NAME, checkpoint_name, step_of
from mpckpt.restore import load_checkpoint
from mpckpt.storage import Backend, open_backend, spec_for_url

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


def load(root: str | os.PathLike[str], step: int | None = None, *, allow_pickle: bool = False,
         storage_options: Mapping[str, Any] | None = None, classes: bool = True) -> Any:
    """The plain nested state (dicts of tensors) of the latest committed checkpoint, or ``step``.

    Values come back as they were saved (numpy arrays, namedtuples, dataclasses, Enum members
    ...). With ``classes=False`` namedtuples and dataclasses come back as dicts of their fields
    and Enum members as their names, without importing their classes: a checkpoint whose
    classes were renamed or removed still loads.

    ``root`` may also be the path or URL of one checkpoint's folder (``runs/exp1/step_0000000042``,
    what Ray Train's ``Result.checkpoint.path`` holds): that checkpoint is loaded.

    Needs no model or optimizer objects and never writes. Every file is verified. A reader
    may run beside a live writer whose retention deletes old checkpoints: a checkpoint deleted
    while it is read, or between listing and reading its manifest, is not damage; the newest
    one is looked up again.
    """
    options = dict(storage_options or {})
    folder = _checkpoint_folder(root, options)
    if folder is not None:
        parent, folder_step = folder
        if step is not None and step != folder_step:
            raise CheckpointNotFoundError(f"{root} is the checkpoint of step {folder_step}, not of step {step}")
        return load_newest(parent, folder_step, allow_pickle=allow_pickle, classes=classes)[1]
    backend = open_backend(spec_for_url(root, options))
    return load_newest(backend, step, allow_pickle=allow_pickle, classes=classes)[1]


def _checkpoint_folder(root: str | os.PathLike[str], options: dict[str, Any]) -> tuple[Backend, int] | None:
    """``(backend of the parent root, step)`` when ``root`` names one committed checkpoint's folder."""
    text = os.fspath(root).rstrip("/")
    head, _, name = text.rpartition("/")
    step = step_of(name)
    if step is None or not head or head.endswith(":/"):
        return None
    try:
        parent = open_backend(spec_for_url(head, options))
        return (parent, step) if parent.exists(f"{name}/{MANIFEST_NAME}") else None
    except MpckptError:
        return None


def load_newest(backend: Backend, step: int | None = None, *, allow_pickle: bool = False,
                classes: bool = True, kind: str | None = None) -> tuple[int, Any]:
    """``(step, state)`` of the newest committed checkpoint (of ``kind``, if given), or of ``step``;
    as ``load``, safe beside a writer whose retention deletes what was just listed."""
    for attempt in range(_LOAD_ATTEMPTS):
        problems: dict[int, Exception] = {}
        committed = scan(backend, clean=False, problems=problems)
        if kind is not None:
            committed = {s: m for s, m in committed.items() if m.kind == kind}
        chosen = max([*committed, *problems], default=None) if step is None else step
        if chosen in problems:  # say why the newest (or requested) one cannot be read
            raise problems[chosen]
        if chosen is None:
            # A writer may have committed a newer one after the listing and deleted the one listed
            # before its manifest was read: look again while there are checkpoint folders at all.
            if attempt < _LOAD_ATTEMPTS - 1 and any(step_of(n) is not None for n in backend.list_names()):
                continue
            raise CheckpointNotFoundError(f"no committed checkpoint in {backend.url}")
        if chosen not in committed:
            raise CheckpointNotFoundError(f"no committed checkpoint of step {step} in {backend.url}; "
                                          f"committed steps: {sorted(committed)[-10:]}")
        name = checkpoint_name(chosen)
        try:
            return chosen, load_checkpoint(backend, name, committed[chosen], allow_pickle=allow_pickle, classes=classes)
        except MpckptError as e:
            if _still_committed(backend, name):
                raise
            if step is not None:
                raise CheckpointNotFoundError(
                    f"the checkpoint of step {step} in {backend.url} was deleted while it was read "
                    "(retention of the run writing there); load a newer one") from e
            log.info("mpckpt: %s was deleted while it was read; looking for the newest again", name)
    raise CheckpointNotFoundError(f"{backend.url}: each newest checkpoint was deleted while it was read, "
                                  f"{_LOAD_ATTEMPTS} times; the writer keeps too few (keep_last) for readers")


def _still_committed(backend: Any, name: str) -> bool:
    """Whether ``name`` still has its manifest (retention deletes the manifest first)."""
    try:
        return bool(backend.exists(f"{name}/{MANIFEST_NAME}"))
    except MpckptError:
        return True  # cannot tell: report the original error
