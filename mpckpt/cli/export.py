"""``mpckpt export ROOT [STEP|latest] --to FILE.safetensors|FILE.pt [--prefix P] [--force]``: one
file other tools read, of one checkpoint (the newest without a step).

The state is loaded as ``mpckpt.load`` would (every file verified) and written to one local
file: ``.safetensors`` gets its tensors under their dotted state paths (``model.0.weight``);
``.pt`` (or ``.pth``) gets the plain nested state, ``torch.save``'d. ``--prefix model.``
exports only that part of the state, the prefix stripped from every name, so a model's
weights go straight to ``load_state_dict`` or ``from_pretrained``. ``--format dcp`` writes
the state as a torch.distributed.checkpoint folder instead (``--to DIR``, new or empty) that
``dcp.load(state_dict, checkpoint_id=DIR)`` reads into an unsharded or sharded state.
``--format hf`` writes one model as a Hugging Face model folder (``--to DIR``, new or empty) that
``from_pretrained(DIR)`` reads: ``model.safetensors`` or shards past ``--max-shard-size`` and
their index, with the ``config.json`` the checkpoint holds (see ``_export_hf``);
``mpckpt.export_hf`` does it from Python.

Tensors that share storage (tied weights) are written the way ``safetensors.torch.save_model``
and transformers write them: of names that are the same tensor, the first in state order is
kept and the others are dropped, each listed in the file's metadata as ``dropped -> kept``
(``safetensors.torch.load_model`` and ``from_pretrained`` tie them again; for
``load_state_dict`` pass ``strict=False``). ``--copy-tied`` writes every name with its own
copy instead, so a strict ``load_state_dict`` finds every key. Different views of one storage
are written each as its own copy. Values that are not tensors are left out of a safetensors
file (and counted); a ``.pt`` file keeps them.

INVARIANT: the file appears whole or not at all: it is written under a temporary name in its
folder, flushed to disk, then linked into place (create-only: an existing file is replaced
only with ``--force``). Bad arguments (unknown step, existing target, a prefix that names
nothing, a suffix or dtype the format cannot hold) are status 2; damage is status 1.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from mpckpt._futures import size_text
from mpckpt.cli import _export_dcp, _export_hf
from mpckpt.cli._common import (
    BadArguments,
    backend_for,
    children,
    chosen_step,
    dotted,
    fsync_path,
    say,
    shorten,
    state_items,
)
from mpckpt.errors import MpckptError, StateError
from mpckpt.format.manifest import checkpoint_name

_SUFFIXES = {".safetensors": "safetensors", ".pt": "pt", ".pth": "pt"}
# what the safetensors format holds (its own names); anything else is refused with a hint
_SAFETENSORS_DTYPES = ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8",
                       "bool", "uint16", "uint32", "uint64", "complex64", "float8_e4m3fn", "float8_e5m2",
                       "float8_e4m3fnuz", "float8_e5m2fnuz")


def run(args: argparse.Namespace) -> int:
    target = Path(args.to)
    fmt = getattr(args, "format", None)
    if fmt == "hf":
        return _run_hf(args, target)
    if getattr(args, "max_shard_size", None) is not None:
        raise BadArguments("--max-shard-size is for --format hf (a Hugging Face folder) only")
    kind = "dcp" if fmt == "dcp" else _SUFFIXES.get(target.suffix.lower())
    if kind is None:
        raise BadArguments(f"--to {args.to}: name a .safetensors file (tensors by dotted path) or a .pt file "
                           "(the nested state, torch.save'd), or pass --format dcp or --format hf and a folder")
    if kind == "dcp":  # a folder DCP reads: _export_dcp checks the target and writes it
        _export_dcp.check_target(target)
    else:
        _check_target(target, force=args.force)
    step, state = _load(args.root, args.step, storage_options=args.storage_options, allow_pickle=args.allow_pickle)
    state = subtree(state, args.prefix or "", step=step)
    if kind == "dcp":
        _export_dcp.write(target, state, what=f"step {step}{_part(args.prefix)}")
        return 0
    if kind == "pt":
        _write(target, lambda path: _torch_save(state, path), force=args.force)
        say(f"wrote {target}: step {step}{_part(args.prefix)} as the nested state (torch.save)")
        return 0
    tensors, skipped = tensors_by_name(state)
    if not tensors:
        raise BadArguments(f"step {step}{_part(args.prefix)} holds no tensors; nothing to export")
    tensors, dropped = untie(tensors, copy_tied=args.copy_tied)
    metadata = {"format": "pt"}  # what transformers' from_pretrained expects of a PyTorch file
    for name, kept in dropped.items():
        metadata.setdefault(name, kept)  # safetensors.torch.save_model's convention
    _write(target, lambda path: _save_safetensors(tensors, metadata, path), force=args.force)
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    say(f"wrote {target}: step {step}{_part(args.prefix)}, {len(tensors)} tensors, {size_text(size)}")
    _say_left_out(dropped, skipped)
    return 0


def export_hf(root: str | os.PathLike[str], step: int | None = None, *, to: str | os.PathLike[str],
              prefix: str | None = None, max_shard_size: int | str = _export_hf.DEFAULT_MAX_SHARD_SIZE,
              force: bool = False, copy_tied: bool = False, allow_pickle: bool = False,
              storage_options: Mapping[str, Any] | None = None) -> Path:
    """Write a committed checkpoint's model (the newest without ``step``) as a Hugging Face model
    folder ``to`` that ``from_pretrained(to)`` reads; return its path. ``mpckpt export ROOT STEP
    --to DIR --format hf`` from Python.

    ``prefix`` (``"model."``) names the part of the state that is the model's weights; without it,
    the state must be one model's weights itself (a state that holds more is a ``ConfigError``
    naming the parts that are; ``prefix=""`` takes every tensor of the state). The weights go to
    ``model.safetensors``, or to shards of at most ``max_shard_size`` (``"5GB"``, ``"500MB"``,
    bytes) and ``model.safetensors.index.json``, as ``save_pretrained`` writes them; tied names are
    left out (``copy_tied=True``: written each as its own copy); ``config.json`` and
    ``generation_config.json`` come along when the checkpoint holds them (``MpckptCallback``'s
    saves do). ``to`` must be a new or empty folder (``force=True``: or a folder of model files
    only, replaced whole); it appears whole or not at all. Bad arguments (an unknown step, a
    prefix that names nothing, a folder in the way) raise ``ConfigError`` before anything is
    written; a damaged checkpoint, ``CorruptCheckpointError``.
    """
    options = json.dumps(dict(storage_options)) if storage_options is not None else None
    return _hf(os.fspath(root), step, Path(to), prefix=prefix, max_shard_size=max_shard_size, force=force,
               copy_tied=copy_tied, allow_pickle=allow_pickle, storage_options=options)[0].folder


def _run_hf(args: argparse.Namespace, target: Path) -> int:
    """``--format hf``: the folder, then what was written and what was left out."""
    max_shard_size = args.max_shard_size if args.max_shard_size is not None else _export_hf.DEFAULT_MAX_SHARD_SIZE
    written, step, dropped, skipped = _hf(args.root, args.step, target, prefix=args.prefix,
                                          max_shard_size=max_shard_size, force=args.force, copy_tied=args.copy_tied,
                                          allow_pickle=args.allow_pickle, storage_options=args.storage_options)
    shards = len([f for f in written.files if f.endswith(".safetensors")])
    say(f"wrote {target}: step {step}{_part(args.prefix)} as a Hugging Face model folder, {written.tensors} tensors, "
        f"{size_text(written.bytes)} in {shards} file{'s' if shards > 1 else ''}"
        f"{f' (index: {_export_hf.INDEX_NAME})' if shards > 1 else ''}; from_pretrained({str(target)!r}) reads it")
    if written.config_files:
        say(f"with {' and '.join(written.config_files)} from the checkpoint")
    else:
        say(f"the checkpoint holds no config.json: put the model's config.json into {target} "
            "(model.config.save_pretrained(DIR)) before from_pretrained")
    _say_left_out(dropped, skipped)
    return 0


def _hf(root: str, step: int | None, target: Path, *, prefix: str | None, max_shard_size: int | str, force: bool,
        copy_tied: bool, allow_pickle: bool,
        storage_options: str | None) -> tuple[_export_hf.Written, int, dict[str, str], list[str]]:
    """The Hugging Face folder of ``root``'s ``step``: what was written, the step, the tied names
    left out, the values that are not tensors left out."""
    max_bytes = _export_hf.max_shard_bytes(max_shard_size)  # bad arguments before anything is read
    _export_hf.check_target(target, force=force)
    chosen, state = _load(root, step, storage_options=storage_options, allow_pickle=allow_pickle)
    configs = _export_hf.config_texts(state)
    part = _export_hf.model_part(state, step=chosen) if prefix is None else subtree(state, prefix, step=chosen)
    tensors, skipped = tensors_by_name(part)
    if not tensors:
        raise BadArguments(f"step {chosen}{_part(prefix)} holds no tensors; nothing to export")
    tensors, dropped = untie(tensors, copy_tied=copy_tied)
    written = _export_hf.write(target, tensors, dropped=dropped, configs=configs, max_bytes=max_bytes, force=force)
    return written, chosen, dropped, skipped


def _load(root: str, step: int | None, *, storage_options: str | None, allow_pickle: bool) -> tuple[int, Any]:
    """The committed ``step`` of ``root`` (the newest for None), loaded as ``mpckpt.load`` does."""
    backend = backend_for(root, storage_options)
    manifest = chosen_step(backend, step)
    if manifest.kind != "state":
        raise BadArguments(f"step {manifest.step} is a directory checkpoint (files written by you, not a state); "
                           "read them with Checkpointer(root, read_only=True).checkpoint(step).as_directory()")
    from mpckpt._read.load import load_checkpoint

    try:
        return manifest.step, load_checkpoint(backend, checkpoint_name(manifest.step), manifest,
                                              allow_pickle=allow_pickle)
    except StateError as e:  # a pickled value refused, a class this machine lacks: not damage
        hint = " (mpckpt export --allow-pickle)" if "pickle" in str(e) else ""
        raise BadArguments(f"step {manifest.step}: {e}{hint}") from e


def _say_left_out(dropped: Mapping[str, str], skipped: list[str]) -> None:
    if dropped:
        pairs = ", ".join(f"{name} -> {kept}" for name, kept in dropped.items())
        say(shorten(f"tied names left out (the same tensor; listed in the file's metadata): {pairs}", 2000))
    if skipped:
        say(shorten(f"{len(skipped)} values that are not tensors left out (a .pt file keeps them): "
                    f"{', '.join(skipped)}", 400))


def _part(prefix: str | None) -> str:
    return f" under {prefix!r}" if prefix else ""


def _check_target(target: Path, *, force: bool) -> None:
    if target.is_dir():
        raise BadArguments(f"--to {target} is a folder; name the file to write")
    if not target.parent.is_dir():
        raise BadArguments(f"--to {target}: the folder {target.parent} does not exist")
    if target.exists() and not force:
        raise BadArguments(f"{target} exists; pass --force to replace it")


def subtree(state: Any, prefix: str, *, step: int) -> Any:
    """The part of ``state`` at dotted path ``prefix`` (a trailing dot or none: the same).

    Keys may hold dots themselves (a module's state_dict: ``{"0.weight": ...}``): where no
    key is the next part of the path, the keys that start with the rest of it make a dict of
    their own, the rest stripped, as ``module.state_dict(prefix=...)`` would.
    """
    rest, done = prefix.rstrip("."), ""
    node = state
    while rest:
        match: tuple[str, Any] | None = None
        for key, child in _children(node):
            # the longest key that fits wins: a dict key may itself hold dots
            if (rest == key or rest.startswith(key + ".")) and (match is None or len(key) > len(match[0])):
                match = (key, child)
        if match is not None:
            node, done, rest = match[1], dotted(done, match[0]), rest[len(match[0]) + 1:]
            continue
        inside = {key[len(rest) + 1:]: child for key, child in _children(node) if key.startswith(rest + ".")}
        if inside:
            return inside
        keys = ", ".join(shorten(k, 40) for k, _ in _children(node)[:20]) or "none"
        raise BadArguments(f"--prefix {prefix!r}: step {step} has nothing at {dotted(done, rest)!r}; "
                           f"the keys {f'under {done!r}' if done else 'at the top'} are: {keys}")
    return node


def _children(node: Any) -> list[tuple[str, Any]]:
    return children(node) or []


def tensors_by_name(state: Any) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Every tensor of ``state`` by dotted path, in state order; the paths of the other values."""
    tensors: dict[str, torch.Tensor] = {}
    skipped: list[str] = []
    for path, value in state_items(state):
        if not isinstance(value, torch.Tensor):
            skipped.append(path or "<root>")
        elif not path:
            raise BadArguments("--prefix names one tensor; give the part of the state that holds it")
        elif path in tensors:
            raise BadArguments(f"two tensors of the state have the dotted name {path!r}; export to .pt instead")
        else:
            tensors[path] = value
    return tensors, skipped


def untie(tensors: dict[str, torch.Tensor], *, copy_tied: bool) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors safetensors accepts (no two share memory, all contiguous), and the names dropped
    as the same tensor as an earlier one (``name -> kept``)."""
    supported = {getattr(torch, n) for n in _SAFETENSORS_DTYPES if hasattr(torch, n)}
    out: dict[str, torch.Tensor] = {}
    dropped: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}   # exact view -> first name
    storages: set[tuple[Any, ...]] = set()  # storages a kept tensor uses
    for name, t in tensors.items():
        if t.dtype not in supported:
            raise BadArguments(f"tensor {name!r} is {t.dtype}, which safetensors cannot hold; export to .pt instead")
        storage = (str(t.device), t.untyped_storage().data_ptr())
        view = (*storage, t.dtype, tuple(t.shape), t.stride(), t.storage_offset())
        if t.numel() and view in seen and not copy_tied:
            dropped[name] = seen[view]
            continue
        if t.numel():
            seen.setdefault(view, name)
        if t.numel() and storage in storages:  # a tied name (--copy-tied) or another view of the storage
            t = t.clone(memory_format=torch.contiguous_format)
        storages.add(storage)
        out[name] = t.contiguous()
    return out, dropped


def _save_safetensors(tensors: dict[str, torch.Tensor], metadata: dict[str, str], path: str) -> None:
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(tensors, path, metadata=metadata)
    except SafetensorError as e:
        raise ValueError(str(e)) from e


def _torch_save(state: Any, path: str) -> None:
    torch.save(state, path)


def _write(target: Path, write: Callable[[str], None], *, force: bool) -> None:
    """``write(path)`` to a temporary file beside ``target``, flushed, then put in place."""
    tmp = target.with_name(f".{target.name}.mpckpt-export-{os.getpid()}")
    try:
        try:
            write(str(tmp))
        except (ValueError, TypeError, RuntimeError) as e:  # what the writer refused (safetensors' own error too)
            raise MpckptError(f"cannot write {target}: {type(e).__name__}: {str(e)[:500]}") from e
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        if force:
            os.replace(tmp, target)
        else:
            try:
                os.link(tmp, target)  # INVARIANT: create-only, so a file made meanwhile is never replaced
            except FileExistsError as e:
                raise BadArguments(f"{target} exists; pass --force to replace it") from e
            except OSError:  # a filesystem without hard links: check, then rename
                if target.exists():
                    raise BadArguments(f"{target} exists; pass --force to replace it") from None
                os.replace(tmp, target)
        fsync_path(target.parent)
    except OSError as e:
        raise MpckptError(f"cannot write {target}: {e}") from e
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
