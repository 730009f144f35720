"""The manifest: the one file whose presence makes a checkpoint exist.

``manifest.json`` lists every file of a checkpoint with its size and xxh3-64 checksum, the
step, the sequence number, the metrics and the format version, and carries a checksum of its
own canonical text so that a torn or edited manifest is refused rather than trusted. It is
always written last (see ``mpckpt.storage.base``).

A file may live in an earlier checkpoint's folder (``ref``): unchanged tensors are then
referenced, not written again. Retention never deletes a folder still referenced.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

import xxhash

from mpckpt.errors import CorruptCheckpointError, UnsupportedFormatError
from mpckpt.storage.base import check_relpath

FORMAT_NAME = "mpckpt"
FORMAT_VERSION = 1
CHECKSUM_ALGO = "xxh3_64"
SKELETON_NAME = "skeleton.json"
STEP_PREFIX = "step_"


def checkpoint_name(step: int) -> str:
    """Folder name of the checkpoint of ``step`` (sorts by step up to 10**10)."""
    return f"{STEP_PREFIX}{step:010d}"


def step_of(name: str) -> int | None:
    """The step a folder name stands for, or None for folders that are not checkpoints."""
    if not name.startswith(STEP_PREFIX):
        return None
    digits = name[len(STEP_PREFIX):]
    return int(digits) if digits.isdigit() else None


def checksum(data: bytes | memoryview) -> str:
    return xxhash.xxh3_64(data).hexdigest()


@dataclass(frozen=True)
class FileEntry:
    size: int
    checksum: str
    ref: str | None = None  # name of the checkpoint folder that holds the file, if not this one

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"size": self.size, CHECKSUM_ALGO: self.checksum}
        if self.ref is not None:
            doc["ref"] = self.ref
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

    def location(self, name: str, relpath: str) -> str:
        """Path (relative to the root) of file ``relpath`` of checkpoint ``name``."""
        entry = self.files[relpath]
        return f"{entry.ref or name}/{relpath}"

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
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
        body["manifest_checksum"] = checksum(canonical.encode())
        return (json.dumps(body, sort_keys=True, indent=1) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes, *, path: str) -> Manifest:
        try:
            body = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CorruptCheckpointError(f"{path}: manifest is not valid JSON (torn or damaged write)", path=path) from e
        if not isinstance(body, dict) or body.get("format") != FORMAT_NAME:
            raise CorruptCheckpointError(f"{path}: not an mpckpt manifest", path=path)
        version = body.get("format_version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise UnsupportedFormatError(
                f"{path}: written in format version {version!r}; this mpckpt reads up to {FORMAT_VERSION}. "
                "Upgrade mpckpt to load it",
                path=path,
            )
        claimed = body.pop("manifest_checksum", None)
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
        if claimed != checksum(canonical.encode()):
            raise CorruptCheckpointError(f"{path}: manifest checksum does not match its content", path=path)
        try:
            files = {}
            for rel, entry in body["files"].items():
                check_relpath(rel)
                ref = entry.get("ref")
                if ref is not None and step_of(ref) is None:
                    raise ValueError(f"file {rel!r} refers to {ref!r}, which is not a checkpoint folder")
                size = entry["size"]
                if not isinstance(size, int) or size < 0:
                    raise ValueError(f"file {rel!r} has a bad size {size!r}")
                files[rel] = FileEntry(size, str(entry[CHECKSUM_ALGO]), ref)
            return cls(
                step=int(body["step"]),
                seq=int(body["seq"]),
                kind=str(body["kind"]),
                files=files,
                metrics=dict(body.get("metrics") or {}),
                created_unix=float(body["created_unix"]),
                world_size=int(body.get("world_size", 1)),
                format_version=version,
            )
        except Exception as e:
            raise CorruptCheckpointError(f"{path}: manifest is malformed ({e})", path=path) from e


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
