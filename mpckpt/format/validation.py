"""``validation.json``: the metrics ``validate=`` computed for a committed checkpoint.

A committed checkpoint is never changed: its manifest is written once, last, and never
replaced. Object stores have no rename, so a second manifest could only overwrite the first
in place, and a crash or a reader in the middle of that must never make a committed
checkpoint unreadable. So the metrics a validation computes after the commit go into a file
of their own, ``validation.json`` in the checkpoint's folder, written once the validation has
succeeded, with a checksum of its own canonical text (as the manifest has).

The manifest says whether such a file may come (``Manifest.validate``, written only when the
Checkpointer had ``validate=``), so a scan reads it only for those checkpoints: the others,
and every checkpoint of an mpckpt before this file existed, cost no extra request.

Readers join its metrics into the manifest's (``joined``, done by ``catalog.read_manifest``):
``best()``, ``KeepBest``, ``mpckpt ls`` and ``Checkpoint.metrics`` see one set of metrics. A
validation metric named like a metric given to ``save`` wins there; the manifest keeps the
original.

Crash safety: the file is one ``write_file`` (fsynced on disk; one object put on object
stores). A missing, torn or damaged file leaves the checkpoint *not validated*: a warning
for a damaged one, never a damaged checkpoint (its manifest and data are intact), and a
Checkpointer that opens the root with ``validate=`` validates it again and writes the file anew.
The file goes with its folder when the checkpoint is deleted.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Mapping
from typing import Any

from mpckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, MpckptError
from mpckpt.format.manifest import Manifest, checksum

log = logging.getLogger("mpckpt")

VALIDATION_NAME = "validation.json"
FORMAT_NAME = "mpckpt-validation"
MAX_VALIDATION_BYTES = 1 << 20  # a few metrics; larger is not ours
_NON_FINITE = ("nan", "inf", "-inf")


def numeric_metrics(result: Any) -> dict[str, int | float]:
    """What a ``validate`` function returned, as ``{name: number}``; ``TypeError`` naming what is not.

    0-d tensors and numpy scalars count as their number; booleans, strings, ``None`` and
    nested values do not (they could not be ranked by ``KeepBest``).
    """
    if not isinstance(result, Mapping):
        raise TypeError(f"validate= returned {type(result).__name__}, not a dict of metric names to numbers; "
                        "return e.g. {'val_loss': 0.25}")
    out: dict[str, int | float] = {}
    bad = []
    for key, value in result.items():
        if hasattr(value, "item") and callable(value.item) and not isinstance(value, (int, float)):
            try:
                value = value.item()
            except Exception:  # a tensor of many elements: not a number
                pass
        if not isinstance(key, str) or isinstance(value, bool) or not isinstance(value, (int, float)):
            bad.append(f"{key!r}: {type(value).__name__}")
            continue
        out[key] = float(value) if isinstance(value, float) else int(value)  # numpy scalars: plain numbers
    if bad:
        raise TypeError(f"validate= returned values that are not numbers ({', '.join(bad[:5])}); "
                        "return a dict of metric names (str) to numbers (int or float)")
    return out


def to_bytes(step: int, metrics: Mapping[str, int | float], *, created_unix: float | None = None) -> bytes:
    """The file for ``step``'s validation metrics (non-finite numbers as ``"nan"``, ``"inf"``, ``"-inf"``)."""
    body: dict[str, Any] = {
        "format": FORMAT_NAME,
        "step": step,
        "created_unix": time.time() if created_unix is None else created_unix,
        "metrics": {k: (repr(float(v)) if isinstance(v, float) and not math.isfinite(v) else v)
                    for k, v in metrics.items()},
    }
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    body["checksum"] = checksum(canonical.encode())
    return (json.dumps(body, sort_keys=True, indent=1) + "\n").encode()


def from_bytes(data: bytes, *, step: int, path: str) -> dict[str, int | float]:
    """The metrics of a validation file of ``step``; ``CorruptCheckpointError`` if it does not verify."""
    try:
        body = json.loads(data)
        if not isinstance(body, dict) or body.get("format") != FORMAT_NAME:
            raise ValueError("not an mpckpt validation file")
        claimed = body.pop("checksum", None)
        if claimed != checksum(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()):
            raise ValueError("its checksum does not match its content (torn or edited)")
        if body.get("step") != step:
            raise ValueError(f"it is of step {str(body.get('step'))[:20]}, not {step}")
        raw = body.get("metrics")
        if not isinstance(raw, dict):
            raise ValueError("metrics is not an object")
        return numeric_metrics({k: float(v) if isinstance(v, str) and v in _NON_FINITE else v for k, v in raw.items()})
    except (ValueError, TypeError, RecursionError) as e:
        raise CorruptCheckpointError(f"{path}: {str(e)[:200]}", path=path) from e


def read(backend: Any, name: str, manifest: Manifest) -> dict[str, int | float] | None:
    """The validation metrics of checkpoint ``name``, or None when it has none (yet) or they do not verify.

    Never raises for the file itself: a checkpoint whose validation file is missing, damaged or
    cannot be read now is a committed checkpoint without those metrics (a warning says why).
    """
    if not manifest.validate:
        return None
    path = f"{name}/{VALIDATION_NAME}"
    try:
        data = backend.read_bytes(path, max_bytes=MAX_VALIDATION_BYTES)
        return from_bytes(data, step=manifest.step, path=path)
    except CheckpointNotFoundError:
        return None  # not validated yet, or its validation failed
    except MpckptError as e:
        log.warning("mpckpt: %s: the validation metrics of step %d cannot be read, so they are left out: %s",
                    backend.url, manifest.step, e)
        return None


def joined(manifest: Manifest, metrics: Mapping[str, int | float] | None) -> Manifest:
    """``manifest`` as readers see it: ``metrics`` joined into its own (they win), kept in ``validation``."""
    if metrics is None:
        return manifest
    return dataclasses.replace(manifest, metrics={**manifest.metrics, **metrics}, validation=dict(metrics))
