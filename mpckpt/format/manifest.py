"""The manifest: the one file whose presence makes a checkpoint exist.

``manifest.json`` lists every file of a checkpoint with its size and xxh3-64 checksum, the
step, the sequence number, the metrics and the format version, and carries a checksum of its
own canonical text so that a torn or edited manifest is refused rather than trusted. It is
always written last (see ``mpckpt.storage.base``).

A file may live outside the checkpoint's folder: in ``shared/`` (``shared``, format version
3: frozen shards several checkpoints use; a shared file lives as long as any manifest lists
it), or, as an mpckpt before version 3 wrote them, in an earlier checkpoint's folder (``ref``;
still read, and such a folder is never deleted while a checkpoint references it).

``figures`` (optional) is what the save cost, as the committer measured it (``mpckpt
stats``). Optional keys like it do not change the format version: every mpckpt ignores keys
it does not know (the checksum covers them all), and a manifest without them still loads.
The same holds inside ``figures``: a reader keeps the figures it knows (``FIGURES``), and one
a manifest lacks (``durable_ms`` and ``waiting`` came later) is None: "not recorded".
So is ``validate`` (true when saved with ``validate=``): the metrics a validation computes
after the commit live in ``validation.json`` beside it (``format/validation.py``), because a
committed manifest is never replaced; readers join them into ``metrics`` (``validation``).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mpckpt.errors import CorruptCheckpointError, UnsupportedFormatError
from mpckpt.format.checksums import checksum
from mpckpt.format.names import (  # noqa: F401 -- re-exported: the names of the format
    MANIFEST_NAME,
    SKELETON_NAME,
    STEP_PREFIX,
    USER_FILES,
    check_relpath,
    checkpoint_name,
    is_shared_path,
    rank_skeleton_name,
    step_of,
)

FORMAT_NAME = "mpckpt"
FORMAT_VERSION = 4  # the newest this mpckpt reads; see ``format_version_for``
CHECKSUM_ALGO = "xxh3_64"
KINDS = ("state", "directory")
MAX_MANIFEST_BYTES = 64 << 20  # a manifest of 100k files is ~15 MB; larger is not ours
# what a save cost, each a number or null (blocked_ms: the save had not returned yet when
# the manifest was written, as with mode=SYNC, which waits for this very commit; durable_ms,
# from the save to the manifest's write, and waiting, the later saves taken and not yet durable
# then: null in manifests of an mpckpt that did not record them)
FIGURES = ("blocked_ms", "snapshot_ms", "persist_ms", "bytes", "written_bytes", "durable_ms", "waiting")


def format_version_for(kind: str, files: Mapping[str, FileEntry] | None = None, *, ranked: bool = False) -> int:
    """The format version a new manifest of ``kind`` listing ``files`` is written in.

    Version 2 keeps a directory checkpoint's files under ``files/``, so that no file of the
    user's (their own ``manifest.json``) can collide with mpckpt's; an mpckpt that reads only
    version 1 then refuses it rather than hand back a ``files/`` folder. Version 3: a state
    that lists files in ``shared/``; an older mpckpt would look for them in the checkpoint's
    folder, so it refuses the manifest instead ("upgrade mpckpt"). A state without shared
    files stays version 1, readable by every mpckpt. Version 4: a state several ranks saved
    (``ranked``): a skeleton per rank and rank-prefixed shards (``names.rank_prefix``).
    """
    if ranked:
        return 4
    if files is not None and any(e.shared is not None for e in files.values()):
        return 3
    return 2 if kind == "directory" else 1


@dataclass(frozen=True)
class FileEntry:
    size: int
    checksum: str
    ref: str | None = None  # name of the checkpoint folder that holds the file (before version 3)
    shared: str | None = None  # its path in ``shared/`` (version 3), if it lives there

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"size": self.size, CHECKSUM_ALGO: self.checksum}
        if self.ref is not None:
            doc["ref"] = self.ref
        if self.shared is not None:
            doc["shared"] = self.shared
        return doc


@dataclass(frozen=True)
class Manifest:
    step: int
    seq: int
    kind: str  # "state" (tensors + skeleton) or "directory" (files the user wrote)
    files: dict[str, FileEntry]
    metrics: dict[str, Any] = field(default_factory=dict)
    created_unix: float = field(default_factory=time.time)
    world_size: int = 1
    format_version: int = FORMAT_VERSION
    figures: dict[str, float | int | None] | None = None  # see FIGURES; None: not recorded
    validate: bool = False  # saved with validate=: a validation.json may add metrics (format/validation.py)
    # the metrics of that validation.json as a reader joined them into ``metrics``; never written here
    validation: dict[str, Any] | None = field(default=None, compare=False)
    # False for a multi-rank checkpoint's summary as the other ranks learn it (``summary``): all
    # but the files, which only a reader needs (it reads the manifest itself then)
    complete: bool = field(default=True, compare=False)

    def summary(self) -> dict[str, Any]:
        """Everything but the file list (what retention and queries need), as JSON."""
        return {"step": self.step, "seq": self.seq, "kind": self.kind, "metrics": _json_safe_metrics(self.metrics),
                "created_unix": self.created_unix, "world_size": self.world_size,
                "format_version": self.format_version, "figures": self.figures}

    @classmethod
    def from_summary(cls, doc: dict[str, Any]) -> Manifest:
        """The manifest ``summary`` describes, without its files (``complete`` False)."""
        return cls(step=int(doc["step"]), seq=int(doc["seq"]), kind=str(doc["kind"]), files={},
                   metrics=_metrics(doc.get("metrics")), created_unix=float(doc["created_unix"]),
                   world_size=int(doc["world_size"]), format_version=int(doc["format_version"]),
                   figures=_figures(doc.get("figures")), complete=False)

    @property
    def ranked(self) -> bool:
        """Saved by the ranks of a torch.distributed job: a skeleton per rank (``_read.ranked``)."""
        return self.kind == "state" and self.format_version >= 4 and rank_skeleton_name(0) in self.files

    @property
    def user_prefix(self) -> str:
        """Where the user's files of a directory checkpoint are (``files/``; none before version 2)."""
        return USER_FILES if self.kind == "directory" and self.format_version >= 2 else ""

    def user_files(self) -> dict[str, str]:
        """The user's relative path of each file of a directory checkpoint -> its manifest entry name."""
        prefix = self.user_prefix
        return {rel[len(prefix):]: rel for rel in self.files if rel.startswith(prefix)}

    def location(self, name: str, relpath: str) -> str:
        """Path (relative to the root) of file ``relpath`` of checkpoint ``name``."""
        entry = self.files[relpath]
        return entry.shared or f"{entry.ref or name}/{relpath}"

    def shared_files(self) -> set[str]:
        """Paths of the files in ``shared/`` this checkpoint lists (it keeps each alive)."""
        return {e.shared for e in self.files.values() if e.shared is not None}

    def referenced_folders(self) -> set[str]:
        """Other checkpoints' folders this one reads files from (``ref``, before version 3)."""
        return {e.ref for e in self.files.values() if e.ref is not None}

    def to_bytes(self) -> bytes:
        body = {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "step": self.step,
            "seq": self.seq,
            "kind": self.kind,
            "created_unix": self.created_unix,
            "world_size": self.world_size,
            "metrics": _json_safe_metrics(self.metrics),
            "files": {k: v.to_json() for k, v in sorted(self.files.items())},
        }
        if self.figures is not None:
            body["figures"] = dict(self.figures)
        if self.validation is not None:
            raise ValueError("a manifest with validation metrics joined is a reader's view; write the committed one")
        if not self.complete:
            raise ValueError("a manifest summary has no files; write the committed manifest")
        if self.validate:
            body["validate"] = True
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
        body["manifest_checksum"] = checksum(canonical.encode())
        return (json.dumps(body, sort_keys=True, indent=1) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes, *, path: str) -> Manifest:
        try:
            body = json.loads(data)
        except (ValueError, RecursionError) as e:  # also too-deep nesting and too-long integers
            raise CorruptCheckpointError(f"{path}: manifest is not valid JSON (torn or damaged write)", path=path) from e
        if not isinstance(body, dict) or body.get("format") != FORMAT_NAME:
            raise CorruptCheckpointError(f"{path}: not an mpckpt manifest", path=path)
        version = body.get("format_version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise CorruptCheckpointError(f"{path}: manifest format version {str(version)[:20]!r} is not valid", path=path)
        if version > FORMAT_VERSION:
            raise UnsupportedFormatError(
                f"{path}: written in format version {version!r}; this mpckpt reads up to {FORMAT_VERSION}. "
                "Upgrade mpckpt to load it",
                path=path,
            )
        claimed = body.pop("manifest_checksum", None)
        try:
            canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
        except (TypeError, ValueError) as e:  # keys of mixed types cannot be sorted
            raise CorruptCheckpointError(f"{path}: manifest is malformed ({e})", path=path) from e
        if claimed != checksum(canonical.encode()):
            raise CorruptCheckpointError(f"{path}: manifest checksum does not match its content", path=path)
        try:
            if body.get("kind") not in KINDS:
                raise ValueError(f"kind {str(body.get('kind'))[:40]!r} is not one of {KINDS}")
            files = {}
            for rel, entry in body["files"].items():
                check_relpath(rel)
                ref, shared = entry.get("ref"), entry.get("shared")
                if ref is not None and step_of(ref) is None:
                    raise ValueError(f"file {rel!r} refers to {ref!r}, which is not a checkpoint folder")
                if shared is not None and (version < 3 or ref is not None or not is_shared_path(shared)):
                    raise ValueError(f"file {rel!r} names {str(shared)[:80]!r} as its shared file, which is not "
                                     "a file in shared/ of a version 3 manifest")
                size = entry["size"]
                if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                    raise ValueError(f"file {rel!r} has a bad size {size!r}")
                files[rel] = FileEntry(size, str(entry[CHECKSUM_ALGO]), ref, shared)
            step, seq = body["step"], body["seq"]
            for key, value in (("step", step), ("seq", seq)):
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ValueError(f"{key} {str(value)[:40]!r} is not a non-negative integer")
            return cls(
                step=step,
                seq=seq,
                kind=str(body["kind"]),
                files=files,
                metrics=_metrics(body.get("metrics")),
                created_unix=float(body["created_unix"]),
                world_size=int(body.get("world_size", 1)),
                format_version=version,
                figures=_figures(body.get("figures")),
                validate=body.get("validate") is True,
            )
        except Exception as e:
            raise CorruptCheckpointError(f"{path}: manifest is malformed ({str(e)[:200]})", path=path) from e


def _metrics(raw: Any) -> dict[str, Any]:
    """Metrics as written (non-finite floats come back from their repr)."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValueError("metrics is not an object")
    out: dict[str, Any] = {}
    for k, v in raw.items():
        if isinstance(v, str) and v in ("nan", "inf", "-inf"):
            v = float(v)
        out[k] = v
    return out


def _figures(raw: Any) -> dict[str, float | int | None] | None:
    """The known figures, each a finite number or None; anything else is dropped (they are only shown)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError("figures is not an object")
    out: dict[str, float | int | None] = {}
    for key in FIGURES:
        v = raw.get(key)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        out[key] = v if ok else None
    return out


def _json_safe_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in metrics.items():
        if hasattr(v, "item") and callable(v.item):  # 0-d tensors and numpy scalars
            v = v.item()
        if isinstance(v, float) and not math.isfinite(v):
            v = repr(v)
        try:
            json.dumps(v)
        except TypeError:
            v = repr(v)
        out[str(k)] = v
    return out
