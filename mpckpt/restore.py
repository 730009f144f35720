"""Read, verify and load checkpoints; put loaded values back into live objects.

Loading never trusts storage: every file's size and xxh3 checksum is checked against the
manifest (which carries a checksum of its own), every safetensors header is validated
before its offsets are used, and the skeleton is plain JSON that is never evaluated.
Pickled values are refused unless the caller passes ``allow_pickle=True``.

Shards are read in parallel with ranged reads straight into one buffer per file; tensors
are views of those buffers (no second copy). A tqdm bar is shown when stderr is a terminal.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import sys
from typing import Any

import torch
import xxhash

from mpckpt import _dtypes
from mpckpt._snapshot import build_tensors, unflatten
from mpckpt.errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError, StateError
from mpckpt.format.manifest import SKELETON_NAME, Manifest
from mpckpt.format.safetensors import header_length, parse_header
from mpckpt.storage import Backend

_READ_CHUNK = 64 << 20
SKELETON_VERSION = 1


def _progress(total: int, desc: str) -> Any:
    if not sys.stderr.isatty() or os.environ.get("MPCKPT_PROGRESS", "1") == "0":
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, leave=False)


def read_verified(backend: Backend, name: str, manifest: Manifest, relpath: str, *, bar: Any = None,
                  pool: concurrent.futures.Executor | None = None) -> torch.Tensor:
    """A whole file of a checkpoint as a uint8 tensor, after checking its size and checksum."""
    entry = manifest.files[relpath]
    location = manifest.location(name, relpath)
    try:
        size = backend.size(location)
    except CheckpointNotFoundError as e:
        raise CorruptCheckpointError(f"{location}: listed in the manifest but missing from storage", path=location) from e
    if size != entry.size:
        raise CorruptCheckpointError(
            f"{location}: {size} bytes on storage, the manifest says {entry.size}; the file is damaged", path=location
        )
    buf = torch.empty(size, dtype=torch.uint8)
    view = buf.numpy().data.cast("B")

    def read(start: int) -> None:
        part = view[start:start + _READ_CHUNK]
        backend.read_into(location, start, part)
        if bar is not None:
            bar.update(len(part))

    starts = range(0, size, _READ_CHUNK)
    if pool is not None and len(starts) > 1:
        list(pool.map(read, starts))
    else:
        for start in starts:
            read(start)
    if xxhash.xxh3_64(view).hexdigest() != entry.checksum:
        raise CorruptCheckpointError(f"{location}: checksum does not match the manifest; the file is damaged",
                                     path=location)
    return buf


def _leaf(spec: dict[str, Any], buffers: dict[str, tuple[torch.Tensor, Any]]) -> torch.Tensor:
    pieces = []
    for filename, key, _start, _end in spec["parts"]:
        buf, header = buffers[filename]
        entry = header.entries.get(key)
        if entry is None:
            raise CorruptCheckpointError(f"{filename}: tensor {key!r} is missing from the shard", path=filename)
        data = buf[header.header_len + entry.start: header.header_len + entry.end]
        pieces.append(data.view(_dtypes.stored_dtype(entry.dtype)).view(entry.shape))
    original = _dtypes.dtype_from_name(spec["dtype"])
    if len(pieces) == 1 and spec["parts"][0][3] == -1:
        stored = pieces[0]
    else:
        stored = torch.cat([p.reshape(-1) for p in pieces])
    if spec.get("raw"):
        return stored
    real_shape = list(spec["shape"]) + ([2] if original in (torch.complex128, torch.complex32) else [])
    if stored.numel() != torch.Size(real_shape).numel():
        raise CorruptCheckpointError(f"tensor {spec['name']!r}: stored {stored.numel()} elements, expected shape {real_shape}")
    return _dtypes.from_stored(stored.view(real_shape), original)


def load_checkpoint(backend: Backend, name: str, manifest: Manifest, *, allow_pickle: bool = False,
                    threads: int = 8) -> Any:
    """The plain nested state of checkpoint ``name``, every file verified."""
    if manifest.kind != "state":
        raise ConfigError(
            f"{name} is a directory checkpoint (files you wrote); read it with Checkpointer.checkpoint(step).as_directory()"
        )
    if SKELETON_NAME not in manifest.files:
        raise CorruptCheckpointError(f"{name}: the manifest lists no {SKELETON_NAME}", path=f"{name}/{SKELETON_NAME}")
    skeleton_buf = read_verified(backend, name, manifest, SKELETON_NAME)
    try:
        skeleton = json.loads(skeleton_buf.numpy().tobytes())
        version = skeleton["version"]
        leaves_spec, table, tree = skeleton["leaves"], skeleton["table"], skeleton["tree"]
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpointError(f"{name}/{SKELETON_NAME} is malformed ({e})", path=f"{name}/{SKELETON_NAME}") from e
    if version > SKELETON_VERSION:
        raise CorruptCheckpointError(f"{name}/{SKELETON_NAME}: skeleton version {version} is newer than this mpckpt")
    shard_names = sorted({part[0] for spec in leaves_spec for part in spec["parts"]})
    missing = [s for s in shard_names if s not in manifest.files]
    if missing:
        raise CorruptCheckpointError(f"{name}: shard {missing[0]} is not listed in the manifest", path=f"{name}/{missing[0]}")
    total = sum(manifest.files[s].size for s in shard_names)
    bar = _progress(total, f"mpckpt load {name}")
    buffers: dict[str, tuple[torch.Tensor, Any]] = {}
    try:
        with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="mpckpt-read") as pool:
            futures = {s: pool.submit(read_verified, backend, name, manifest, s, bar=bar) for s in shard_names}
            for s, fut in futures.items():
                buf = fut.result()
                where = manifest.location(name, s)
                n = header_length(buf[:8].numpy().tobytes(), path=where, file_size=buf.numel())
                header = parse_header(buf[:8 + n].numpy().tobytes(), path=where, file_size=buf.numel())
                buffers[s] = (buf, header)
    finally:
        if bar is not None:
            bar.close()
    try:
        leaves = [_leaf(spec, buffers) for spec in leaves_spec]
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:
        raise CorruptCheckpointError(f"{name}/{SKELETON_NAME}: tensor table does not match the shards ({e})") from e
    tensors = build_tensors(table, leaves)
    return unflatten(tree, tensors, allow_pickle=allow_pickle)


def apply_state(target: Any, loaded: Any, path: str = "") -> Any:
    """Load ``loaded`` into ``target`` in place where possible; return what ``target`` becomes."""
    where = path or "<root>"
    if isinstance(target, torch.Tensor):
        if not isinstance(loaded, torch.Tensor):
            raise StateError(f"state key {where!r}: checkpoint holds a {type(loaded).__name__}, not a tensor", key=path)
        if target.shape != loaded.shape:
            raise StateError(f"state key {where!r}: shape {tuple(loaded.shape)} in the checkpoint, "
                             f"{tuple(target.shape)} in memory", key=path)
        with torch.no_grad():
            target.copy_(loaded)
        return target
    if isinstance(target, dict):
        if not isinstance(loaded, dict):
            raise StateError(f"state key {where!r}: checkpoint holds a {type(loaded).__name__}, not a dict", key=path)
        for k, v in loaded.items():
            target[k] = apply_state(target[k], v, f"{path}.{k}" if path else str(k)) if k in target else v
        return target
    if isinstance(target, list) and isinstance(loaded, list) and len(target) == len(loaded):
        for i, v in enumerate(loaded):
            target[i] = apply_state(target[i], v, f"{path}.{i}" if path else str(i))
        return target
    load_state_dict = getattr(target, "load_state_dict", None)
    if callable(load_state_dict) and not isinstance(target, type):
        load_state_dict(loaded)
        return target
    return loaded
