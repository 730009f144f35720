"""``mpckpt export ROOT [STEP|latest] --to DIR --format hf``: one model of a checkpoint as a
Hugging Face model folder that ``from_pretrained(DIR)`` reads.

DIR gets the weights as ``save_pretrained`` writes them: ``model.safetensors``, or, past
``--max-shard-size`` (default ``5GB``, huggingface_hub's ``save_torch_state_dict`` default; sizes as
it parses them: ``500MB``, ``5GB``, decimal units, or ``2GiB``, or bytes), the shards
``model-00001-of-00003.safetensors`` ... and ``model.safetensors.index.json`` (``{"metadata":
{"total_size": N}, "weight_map": {name: file}}``), filled in state order, a tensor larger than the
limit alone in its shard, as ``split_torch_state_dict_into_shards`` fills them. Every file is
readable by ``safetensors.torch.load_file``, with ``{"format": "pt"}`` in its metadata. Tied weights
are written as by a ``.safetensors`` export: the first name kept, the others left out and listed
in the metadata of the file holding the kept one (``from_pretrained`` ties them again, as it does
for ``save_pretrained``'s folders). ``config.json`` and ``generation_config.json`` are copied when
the checkpoint holds them (``MpckptCallback`` saves them as ``config`` and ``generation_config``);
otherwise the command says to add the model's ``config.json``.

Which part of the state: ``--prefix model.`` exports that part. Without ``--prefix``, the state is
exported as it is when it is one model's weights (every value at its top a tensor, as
``ckpt.save(step, model.state_dict())`` makes it); a state that holds more (``{"model": model,
"optim": opt}``, an ``MpckptCallback`` save) is refused (status 2) naming the parts that are a
model's weights (``--prefix model.``), never guessed at. ``--prefix ''`` takes the whole state.

DIR must be a new or empty folder (status 2 otherwise). ``--force`` replaces a folder that holds a
model folder's files only (``model*.safetensors``, the index, ``config.json``,
``generation_config.json``); a folder with anything else in it is never replaced.
``mpckpt.export_hf(root, step, to=DIR, prefix="model.")`` does the same from Python.

INVARIANT: DIR appears whole or not at all: its files are written into a temporary folder beside
it, each flushed to disk, the folder flushed, then renamed into place (onto nothing or an empty
folder; with ``--force``, the old folder is moved aside first and removed after).

This module owns the folder's layout (file names, shards, index, config files), the choice of the
part without ``--prefix`` and the target checks; ``export`` loads the step and unties the names.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mpckpt.cli._common import BadArguments, fsync_path, shorten
from mpckpt.config import parse_bytes
from mpckpt.errors import ConfigError, MpckptError
from mpckpt.integrations._transformers_folder import CONFIG, GENERATION_CONFIG

DEFAULT_MAX_SHARD_SIZE = "5GB"  # huggingface_hub's MAX_SHARD_SIZE (transformers 5's save_pretrained: 50GB)
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
# the keys of a save that become the folder's config files (what MpckptCallback stores, and
# _transformers_folder.write_folder writes as these names)
CONFIG_FILES = ((CONFIG, "config.json"), (GENERATION_CONFIG, "generation_config.json"))
# what --force may replace: the files this module writes, and nothing else
_MODEL_FILE = re.compile(r"^(model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|"
                         r"config\.json|generation_config\.json)$")


@dataclass
class Written:
    """What one export wrote into ``folder``."""

    folder: Path
    files: list[str] = field(default_factory=list)
    tensors: int = 0
    bytes: int = 0
    config_files: list[str] = field(default_factory=list)


def max_shard_bytes(value: int | str) -> int:
    """``--max-shard-size`` in bytes: ``5GB`` (decimal, as huggingface_hub parses it), ``2GiB``, or bytes."""
    try:
        size = parse_bytes(value, setting="--max-shard-size", available=0)
    except ConfigError as e:
        raise BadArguments(f"--max-shard-size {value!r} is not a size; give one as save_pretrained takes it "
                           "('5GB', '500MB'), a binary one ('2GiB') or a number of bytes") from e
    if size < 1:
        raise BadArguments(f"--max-shard-size {value!r} is less than a byte; give a size such as '5GB' or '500MB'")
    return size


def check_target(target: Path, *, force: bool) -> None:
    """``BadArguments`` unless ``target`` is a new or empty folder in a folder that exists (with
    ``force``: or a folder of a model's files only)."""
    if target.is_dir() and not target.is_symlink():
        foreign = sorted(name for name in os.listdir(target) if not _MODEL_FILE.match(name))
        if foreign and force:
            raise BadArguments(f"--to {target} holds files a model folder export does not write "
                               f"({shorten(', '.join(foreign), 200)}); --force replaces a folder of model files only: "
                               "name a new or empty folder, or remove them")
        if not force and any(target.iterdir()):
            raise BadArguments(f"--to {target} is a folder that is not empty; name a new or empty folder "
                               "(--force replaces a folder of model files: weights, index, config)")
    elif target.exists() or target.is_symlink():
        raise BadArguments(f"--to {target} exists and is not a folder; name a new or empty folder")
    if not target.absolute().parent.is_dir():
        raise BadArguments(f"--to {target}: the folder {target.absolute().parent} does not exist")


def model_part(state: Any, *, step: int) -> Any:
    """``state`` when it is one model's weights (a dict whose top holds tensors only), else the
    ``BadArguments`` that names the parts that are (``--prefix model.``)."""
    if isinstance(state, Mapping) and state and all(isinstance(v, torch.Tensor) for v in state.values()):
        return state
    if not isinstance(state, Mapping):
        raise BadArguments(f"step {step} is a {type(state).__name__}, not a model's weights; name the part that is "
                           "with --prefix")
    models = [f"{key}." for key, value in state.items()
              if isinstance(value, Mapping) and value and all(isinstance(v, torch.Tensor) for v in value.values())]
    keys = shorten(", ".join(str(k) for k in state), 200)
    if models:
        hint = (f"name the model with --prefix {models[0]} (prefix={models[0]!r} in Python); the parts that are a "
                f"model's weights: {', '.join(models)}")
    else:
        hint = "no part of it is a dict of tensors alone; name the model's part with --prefix"
    raise BadArguments(f"step {step} holds more than a model's weights (its keys: {keys}); a Hugging Face folder "
                       f"holds one model's: {hint} (--prefix '' exports every tensor of the state as it is)")


def config_texts(state: Any) -> dict[str, str]:
    """The config files a checkpoint carries (``MpckptCallback``'s ``config``, ``generation_config``),
    by file name, as ``_transformers_folder.write_folder`` writes them."""
    if not isinstance(state, Mapping):
        return {}
    return {name: str(state[key]) for key, name in CONFIG_FILES if isinstance(state.get(key), str)}


def shards(tensors: Mapping[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """The names of each shard, in state order, as huggingface_hub's
    ``split_torch_state_dict_into_shards`` fills them: a tensor larger than ``max_bytes`` alone in its
    own shard (where it comes), the others added to the current shard until the next would pass it."""
    out: list[list[str]] = []
    current: list[str] = []
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > max_bytes:
            out.append([name])
            continue
        if current and size + nbytes > max_bytes:
            out.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    if current or not out:
        out.append(current)
    return out


def write(target: Path, tensors: dict[str, torch.Tensor], *, dropped: Mapping[str, str], configs: Mapping[str, str],
          max_bytes: int, force: bool) -> Written:
    """The folder at ``target``: ``tensors`` (untied, contiguous), ``dropped`` (tied name -> kept)
    in the metadata, the ``configs`` files; written beside it, then renamed into place."""
    parent = target.absolute().parent
    tmp = parent / f".{target.name}.mpckpt-export-{os.getpid()}"
    old = parent / f".{target.name}.mpckpt-replaced-{os.getpid()}"
    written = Written(folder=target)
    try:
        os.mkdir(tmp)
        _write_files(tmp, tensors, dropped=dropped, configs=configs, max_bytes=max_bytes, written=written)
        fsync_path(tmp)
        if force and target.is_dir() and any(target.iterdir()):
            check_target(target, force=True)  # still a folder of model files only
            os.rename(target, old)  # the old one goes aside whole: DIR is never half replaced
        try:
            os.rename(tmp, target)  # INVARIANT: onto nothing or an empty folder only
        except OSError as e:
            if old.exists():
                os.rename(old, target)
            raise BadArguments(f"--to {target}: cannot put the folder in place ({e}); name a new or empty folder") from e
        fsync_path(parent)
    except BadArguments:
        raise
    except (OSError, ValueError, TypeError, RuntimeError) as e:
        raise MpckptError(f"cannot write {target}: {type(e).__name__}: {str(e)[:500]}") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return written


def _write_files(folder: Path, tensors: dict[str, torch.Tensor], *, dropped: Mapping[str, str],
                 configs: Mapping[str, str], max_bytes: int, written: Written) -> None:
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    groups = shards(tensors, max_bytes)
    names = [WEIGHTS_NAME] if len(groups) == 1 else \
        [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map: dict[str, str] = {}
    for file, group in zip(names, groups, strict=True):
        metadata = {"format": "pt"}  # what from_pretrained expects of a PyTorch file
        for name, kept in dropped.items():
            if kept in group:
                metadata.setdefault(name, kept)  # safetensors.torch.save_model's convention
        try:
            save_file({name: tensors[name] for name in group}, str(folder / file), metadata=metadata)
        except SafetensorError as e:
            raise ValueError(str(e)) from e
        fsync_path(folder / file)
        weight_map.update(dict.fromkeys(group, file))
    written.files += names
    written.tensors = len(tensors)
    written.bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    if len(groups) > 1:  # as save_pretrained writes it
        index = {"metadata": {"total_size": written.bytes}, "weight_map": weight_map}
        _write_text(folder / INDEX_NAME, json.dumps(index, indent=2, sort_keys=True) + "\n")
        written.files.append(INDEX_NAME)
    for name, text in configs.items():
        _write_text(folder / name, text)
        written.files.append(name)
        written.config_files.append(name)


def _write_text(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
