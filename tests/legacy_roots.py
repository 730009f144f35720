"""Roots as an mpckpt before format version 3 wrote them: frozen shards in a checkpoint's folder.

``make_legacy(root)`` rewrites a local root written today into that layout: each file of
``shared/`` moves into the folder of the oldest checkpoint that lists it, and every later
manifest that lists it refers to that folder (``"ref"``), in format version 1, checksummed
as such a writer did. Nothing of today's writer is used to make the references.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from mpckpt.format.manifest import FileEntry, Manifest
from mpckpt.format.names import MANIFEST_NAME, checkpoint_name


def manifests_of(root: Path) -> dict[int, Manifest]:
    found = {}
    for folder in sorted(root.glob("step_*")):
        path = folder / MANIFEST_NAME
        m = Manifest.from_bytes(path.read_bytes(), path=str(path))
        found[m.step] = m
    return found


def make_legacy(root: Path) -> dict[int, Manifest]:
    """Rewrite ``root`` in the layout before shared files; return the new manifests by step."""
    manifests = manifests_of(root)
    owner: dict[str, tuple[int, str]] = {}  # shared path -> (oldest step listing it, its name there)
    for step in sorted(manifests):
        for rel, entry in manifests[step].files.items():
            if entry.shared is not None:
                owner.setdefault(entry.shared, (step, rel))
    for path, (step, rel) in owner.items():
        os.replace(root / path, root / checkpoint_name(step) / rel)
    rewritten = {}
    for step, m in manifests.items():
        files = {}
        for rel, entry in m.files.items():
            if entry.shared is None:
                files[rel] = entry
                continue
            first, _ = owner[entry.shared]
            files[rel] = FileEntry(entry.size, entry.checksum, ref=None if first == step else checkpoint_name(first))
        rewritten[step] = dataclasses.replace(m, files=files, format_version=1)
        (root / checkpoint_name(step) / MANIFEST_NAME).write_bytes(rewritten[step].to_bytes())
    if (root / "shared").exists():
        os.rmdir(root / "shared")
    return rewritten
