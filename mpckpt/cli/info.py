"""``mpckpt info ROOT [STEP|latest] [--json]``: what one checkpoint holds (the newest without a
step), without reading its tensors.

For a state (one saved by the ranks of a job: as one, every DTensor at its global shape,
with every rank's shard files): every tensor under its dotted state path (``model.0.weight``, the key ``export``
writes it under) with dtype, shape, bytes and the shard file(s) holding it, tensors that
share storage (tied weights) marked; then every other value (``path = value``, shortened;
a pickled value is named, never unpickled). For a directory checkpoint: its files. ROOT may
also be a plain torch.distributed.checkpoint folder (no STEP): its tensors and the keys of its
other values, from its metadata (read without running code from storage).

Only the manifest and the skeleton are read (the skeleton's checksum is checked); the shards
are not: ``mpckpt verify`` reads every byte. A damaged step or a skeleton that does not parse
is status 1, a step that is not there (or a folder with no checkpoint) 2.

This module owns only the display: the skeleton is interpreted by the loader's own code
(``build_tensors``, ``unflatten``) around meta tensors, so the names are those a load gives,
with no tensor data read.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from typing import Any

from mpckpt._futures import size_text
from mpckpt._read.skeleton import read_rank_skeletons, read_skeleton
from mpckpt._read.sources import StorageSource
from mpckpt.cli import _dcp
from mpckpt.cli._common import (
    backend_for,
    chosen_step,
    iso_time,
    say,
    say_json,
    shorten,
    state_items,
    total_bytes,
)
from mpckpt.errors import CorruptCheckpointError
from mpckpt.format.dcp_metadata import is_dcp_folder
from mpckpt.format.manifest import SKELETON_NAME, Manifest, checkpoint_name

# what a damaged or forged skeleton can make its interpretation raise
_MALFORMED = (KeyError, TypeError, ValueError, IndexError, AttributeError, RecursionError, OverflowError, RuntimeError)


@dataclass
class TensorInfo:
    name: str
    dtype: str
    shape: list[int]
    bytes: int
    shards: list[str]            # where its bytes are, relative to the root
    shares: str | None = None    # the first tensor listed that shares its storage (tied weights)


@dataclass
class ValueInfo:
    name: str
    type: str
    value: Any                   # JSON-native, or the shortened repr


def run(args: argparse.Namespace) -> int:
    backend = backend_for(args.root, args.storage_options)
    if is_dcp_folder(backend):  # a plain torch.distributed.checkpoint folder: _dcp describes it
        return _dcp.info(backend, args)
    manifest = chosen_step(backend, args.step)
    name = checkpoint_name(manifest.step)
    tensors: list[TensorInfo] = []
    values: list[ValueInfo] = []
    stored = 0
    if manifest.ranked:  # saved by the ranks of a job: rank 0's view, with global shapes
        tensors, values, stored = describe(_ranked_doc(backend, name, manifest), manifest, name)
    elif manifest.kind == "state":
        skeleton = read_skeleton(StorageSource(backend, name, manifest))  # size, checksum, version and shape checked
        doc = {"tree": skeleton.tree, "table": skeleton.table, "leaves": skeleton.leaves}
        tensors, values, stored = describe(doc, manifest, name)
    files = [{"path": path, "bytes": manifest.files[rel].size, "location": manifest.location(name, rel)}
             for path, rel in sorted(manifest.user_files().items())] if manifest.kind == "directory" else []
    if args.json:
        say_json({"step": manifest.step, "time": iso_time(manifest.created_unix), "kind": manifest.kind,
                  "bytes": total_bytes(manifest), "tensor_bytes": stored, "metrics": manifest.metrics,
                  "tensors": [asdict(t) for t in tensors], "values": [asdict(v) for v in values], "files": files})
        return 0
    say(f"step {manifest.step}: {manifest.kind}, committed {iso_time(manifest.created_unix)}, "
        f"{len(manifest.files)} files, {size_text(total_bytes(manifest))}, metrics {json.dumps(manifest.metrics)}")
    if manifest.kind == "state":
        _say_tensors(tensors, stored)
        say(f"values: {len(values)}")
        for v in values:
            say(f"  {v.name} = {v.value if isinstance(v.value, str) and v.type != 'str' else json.dumps(v.value)}")
    else:
        say(f"files: {len(files)}")
        for f in files:
            say(f"  {f['path']}  {f['bytes']} bytes")
    return 0


def _ranked_doc(backend: Any, name: str, manifest: Manifest) -> dict[str, Any]:
    """A multi-rank checkpoint as one skeleton: rank 0's tree and table, each DTensor at its
    global shape and every tensor with the shard files of every rank that stored part of it
    (PerRank values: rank 0's, as a list of one)."""
    skeletons = read_rank_skeletons(StorageSource(backend, name, manifest))  # sizes, checksums and shape checked
    files: dict[str, list[Any]] = {}
    for sk in skeletons:
        for spec in sk.leaves:
            if spec["kind"] != "local":
                files.setdefault(spec["name"], []).extend(spec.get("parts", []))
    leaves = []
    for spec in skeletons[0].leaves:
        spec = dict(spec)
        if spec["kind"] == "sharded":
            spec["shape"] = spec["global_shape"]
        if spec["kind"] != "local":
            spec["parts"] = files.get(spec["name"], [])
        spec.setdefault("parts", [])
        leaves.append(spec)
    return {"tree": skeletons[0].tree, "table": skeletons[0].table, "leaves": leaves}


def _say_tensors(tensors: list[TensorInfo], stored_bytes: int) -> None:
    say(f"tensors: {len(tensors)} ({size_text(stored_bytes)}; storage they share counted once)")
    if not tensors:
        return
    rows = [("NAME", "DTYPE", "SHAPE", "BYTES", "SHARD")]
    rows += [(t.name, t.dtype, str(t.shape), str(t.bytes),
              ", ".join(t.shards) + (f"  (same storage as {t.shares})" if t.shares else "")) for t in tensors]
    widths = [min(60, max(len(r[i]) for r in rows)) for i in range(4)]
    for r in rows:
        say("  " + "  ".join([r[0].ljust(widths[0]), r[1].ljust(widths[1]), r[2].ljust(widths[2]),
                              r[3].rjust(widths[3]), r[4]]))


def describe(doc: Any, manifest: Manifest, name: str) -> tuple[list[TensorInfo], list[ValueInfo], int]:
    """The tensors and the other values of a skeleton, in state order, by dotted path, and the
    bytes of tensor data stored (storage that tensors share counted once).

    The tree is rebuilt by the loader's own ``unflatten`` (every node checked, nothing
    unpickled, no class imported) around meta tensors: no tensor data is read or allocated.
    """
    import torch

    from mpckpt import _dtypes
    from mpckpt._codec.tree import build_tensors, unflatten

    where = f"{name}/{SKELETON_NAME}"
    try:
        specs, table = doc["leaves"], doc["table"]
        metas = [torch.empty(spec["shape"], dtype=_dtypes.dtype_from_name(spec["dtype"]), device="meta")
                 for spec in specs]
        shards = [list(dict.fromkeys(str(part[0]) for part in spec["parts"])) for spec in specs]
        rows = build_tensors(table, metas)
        leaf_of: dict[int, int] = {}  # tensor object -> index of the leaf whose bytes it is
        for row, tensor in zip(table, rows, strict=True):
            leaf_of.setdefault(id(tensor), row["leaf"] if "leaf" in row else row["view_of"])
        state = unflatten(_mark_pickles(doc["tree"]), rows, check_only=True)
        items = list(state_items(state, whole=_plain_sequence))
    except (CorruptCheckpointError, *_MALFORMED) as e:
        raise CorruptCheckpointError(f"{where}: malformed ({str(e)[:300]})", path=where) from e
    tensors: list[TensorInfo] = []
    values: list[ValueInfo] = []
    first_of_leaf: dict[int, str] = {}
    for path, value in items:
        label = path or "<root>"
        if not isinstance(value, torch.Tensor):
            values.append(_value(label, value))
            continue
        leaf = leaf_of.get(id(value), -1)
        first = first_of_leaf.setdefault(leaf, label)
        tensors.append(TensorInfo(
            label, str(value.dtype).removeprefix("torch."), list(value.shape), value.numel() * value.element_size(),
            [manifest.location(name, s) if s in manifest.files else s for s in (shards[leaf] if leaf >= 0 else [])],
            None if first == label or leaf < 0 else first))
    return tensors, values, sum(m.numel() * m.element_size() for m in metas)


class _Pickled:
    """Stands in for a pickled value: it is named, never unpickled."""

    def __init__(self, encoded: Any) -> None:
        self.nbytes = len(encoded) * 3 // 4 if isinstance(encoded, str) else 0

    def __repr__(self) -> str:
        return f"<pickled value of {self.nbytes} bytes, not unpickled>"


def _mark_pickles(node: Any) -> Any:
    """The tree with each pickle node replaced by a ``_Pickled`` (``unflatten`` passes it through)."""
    from mpckpt._codec.values import TAG

    if isinstance(node, list):
        return [_mark_pickles(x) for x in node]
    if not isinstance(node, dict):
        return node
    if node.get(TAG) == "pickle":
        return _Pickled(node.get("v"))
    return {k: _mark_pickles(v) for k, v in node.items()}


def _plain_sequence(node: Any) -> bool:
    """A list or tuple of plain values is one value (an optimizer's ``params``: ``[0, 1, 2]``)."""
    return isinstance(node, (list, tuple)) and not hasattr(node, "_fields") and all(
        x is None or isinstance(x, (bool, int, float, str)) for x in node)


def _value(label: str, value: Any) -> ValueInfo:
    native = value is None or isinstance(value, (bool, int, str)) or isinstance(value, float) and math.isfinite(value)
    shown = shorten(value, 200) if isinstance(value, str) else value if native else shorten(repr(value))
    kind = "pickle" if isinstance(value, _Pickled) else type(value).__name__
    return ValueInfo(label, kind, shown)
