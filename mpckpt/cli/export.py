"""``mpckpt export ROOT [STEP|latest] --to FILE.safetensors|FILE.pt [--prefix P] [--force]``: one
file other tools read, of one checkpoint (the newest without a step).

The state is loaded as ``mpckpt.load`` would (every file verified) and written to one local
file: ``.safetensors`` gets its tensors under their dotted state paths (``model.0.weight``);
``.pt`` (or ``.pth``) gets the plain nested state, ``torch.save``'d. ``--prefix model.``
exports only that part of the state, the prefix stripped from every name, so a model's
weights go straight to ``load_state_dict`` or ``from_pretrained``. ``--format dcp`` writes
the state as a torch.distributed.checkpoint folder instead (``--to DIR``, new or empty) that
``dcp.load(state_dict, checkpoint_id=DIR)`` reads into an unsharded or sharded state.

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
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mpckpt._futures import size_text
from mpckpt.cli import _export_dcp
from mpckpt.cli._common import (
    BadArguments,
    backend_for,
    children,
    chosen_step,
    dotted,
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
    kind = "dcp" if getattr(args, "format", None) == "dcp" else _SUFFIXES.get(target.suffix.lower())
    if kind is None:
        raise BadArguments(f"--to {args.to}: name a .safetensors file (tensors by dotted path) or a .pt file "
                           "(the nested state, torch.save'd), or pass --format dcp and a folder")
    if kind == "dcp":  # a folder DCP reads: _export_dcp checks the target and writes it
        _export_dcp.check_target(target)
    else:
        _check_target(target, force=args.force)
    backend = backend_for(args.root, args.storage_options)
    manifest = chosen_step(backend, args.step)
    step = manifest.step
    if manifest.kind != "state":
        raise BadArguments(f"step {step} is a directory checkpoint (files written by you, not a state); "
                           "read them with Checkpointer(root, read_only=True).checkpoint(step).as_directory()")
    from mpckpt._read.load import load_checkpoint

    try:
        state = load_checkpoint(backend, checkpoint_name(step), manifest, allow_pickle=args.allow_pickle)
    except StateError as e:  # a pickled value refused, a class this machine lacks: not damage
        hint = " (mpckpt export --allow-pickle)" if "pickle" in str(e) else ""
        raise BadArguments(f"step {step}: {e}{hint}") from e
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
    if dropped:
        pairs = ", ".join(f"{name} -> {kept}" for name, kept in dropped.items())
        say(shorten(f"tied names left out (the same tensor; listed in the file's metadata): {pairs}", 2000))
    if skipped:
        say(shorten(f"{len(skipped)} values that are not tensors left out (a .pt file keeps them): "
                    f"{', '.join(skipped)}", 400))
    return 0


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
        _fsync_dir(target.parent)
    except OSError as e:
        raise MpckptError(f"cannot write {target}: {e}") from e
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

