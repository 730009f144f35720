"""The ``.metadata`` file of a torch.distributed.checkpoint (DCP) folder, read without running
code from storage.

DCP's ``FileSystemWriter`` writes a folder's metadata with ``pickle.dump`` and its own
``FileSystemReader`` reads it back with ``pickle.load``: whoever can write the folder can run
code in every process that opens it. ``read_metadata`` unpickles it with an unpickler whose
``find_class`` answers only the globals below (every other global, however it is asked for:
``GLOBAL``, ``STACK_GLOBAL``, ``INST``, ``OBJ``, the copyreg extension codes, is refused before
anything is imported or called; a persistent id is refused too):

- ``torch.distributed.checkpoint.metadata``: ``Metadata``, ``TensorStorageMetadata``,
  ``BytesStorageMetadata``, ``ChunkStorageMetadata``, ``TensorProperties``, ``MetadataIndex``,
  ``StorageMeta`` (DCP's dataclasses: what is stored, its shape, dtype and chunks, the key of
  each item) and ``_MEM_FORMAT_ENCODING`` (the enum ``TensorProperties`` pickles its memory
  format as);
- ``torch.distributed.checkpoint.filesystem``: ``_StorageInfo`` (the file, offset and length
  of each item);
- ``torch.Size``, and ``torch.<name>`` where that name is a ``torch.dtype``, ``torch.layout``
  or ``torch.memory_format`` (a dtype pickles as its global name);
- ``torch.serialization._get_layout`` (how a ``torch.layout`` pickles: a lookup of its name
  in a table of layouts);
- ``pathlib.PosixPath``, ``PurePosixPath``, ``PureWindowsPath`` (``StorageMeta.checkpoint_id``
  when ``dcp.save`` was given a ``Path``; ``WindowsPath`` is read as ``PureWindowsPath``);
- ``collections.OrderedDict``, ``builtins.set`` and ``builtins.frozenset`` (containers that
  older pickle protocols name).

Plain values (None, bools, ints, floats, strings, bytes, tuples, lists, dicts, sets) need no
global. These are exactly what a default ``FileSystemWriter`` pickles for any state (models,
optimizers with state, non-tensor values, every dtype, DTensor shards of any number of ranks).
Calling one of them can only build DCP's metadata records, a size, a path or a container;
what ``TensorProperties.__setstate__`` runs is DCP's own decoding of its memory format. None of
them is handed out as the object the rest of the process uses where pickle could change it
(``_fenced``): DCP's classes come as subclasses made for one load, so a file cannot rebind
their methods for anyone else.
``allow_pickle=True`` (the caller trusts the folder) unpickles with plain ``pickle`` instead.

After unpickling, ``check_metadata`` checks the shape of what came back (types, non-negative
offsets and lengths, plain file names, chunk ranks) before anything is read by it: a forged
file is ``CorruptCheckpointError`` naming it, never an exception from deep inside a reader.

This module imports torch only inside its functions: the rest of ``format`` stays torch-free.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

from mpckpt.errors import CorruptCheckpointError, StateError

METADATA_NAME = ".metadata"  # DCP's name for the metadata of a folder (filesystem._metadata_fn)
DATA_SUFFIX = ".distcp"      # DCP's default suffix of its data files
_DCP_META = "torch.distributed.checkpoint.metadata"
_DCP_FS = "torch.distributed.checkpoint.filesystem"
_CLASSES = {
    (_DCP_META, "Metadata"), (_DCP_META, "TensorStorageMetadata"), (_DCP_META, "BytesStorageMetadata"),
    (_DCP_META, "ChunkStorageMetadata"), (_DCP_META, "TensorProperties"), (_DCP_META, "MetadataIndex"),
    (_DCP_META, "StorageMeta"), (_DCP_META, "_MEM_FORMAT_ENCODING"), (_DCP_FS, "_StorageInfo"),
}
_PATHS = {"PosixPath": "PosixPath", "PurePosixPath": "PurePosixPath", "PureWindowsPath": "PureWindowsPath",
          "WindowsPath": "PureWindowsPath"}
_CONTAINERS = {("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset")}


def is_dcp_folder(backend: Any) -> bool:
    """Whether the root of ``backend`` (a ``storage.Backend``) is a DCP folder: it holds ``.metadata``."""
    try:
        return bool(backend.exists(METADATA_NAME))
    except CorruptCheckpointError:  # a link or a folder in its place: reading it says so
        return True


def admitted(module: str, name: str) -> Any:
    """The object global ``module.name`` stands for, if the restricted unpickler admits it; else None."""
    import torch

    if (module, name) in _CLASSES:
        import importlib

        return getattr(importlib.import_module(module), name)
    if module == "torch":
        if name == "Size":
            return torch.Size
        value = vars(torch).get(name)  # never getattr: torch's module __getattr__ imports submodules
        return value if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)) else None
    if (module, name) == ("torch.serialization", "_get_layout"):
        return _layout
    if module == "pathlib" and name in _PATHS:
        import pathlib

        return getattr(pathlib, _PATHS[name])
    if (module, name) in _CONTAINERS:
        import builtins
        import collections

        return getattr(collections if module == "collections" else builtins, name)
    return None


def _layout(name: object) -> Any:
    """``torch.serialization._get_layout``: a layout by its name, and nothing else."""
    import torch

    value = vars(torch).get(name.removeprefix("torch.")) if isinstance(name, str) else None
    if not isinstance(value, torch.layout):
        raise pickle.UnpicklingError(f"unknown torch layout {name!r}")
    return value


def _fenced(found: Any) -> Any:
    """What the unpickler hands out for an admitted global: an object this load alone holds
    wherever the real one could be changed.

    Pickle's BUILD sets attributes on whatever object it is given, a class too: handed the real
    ``Metadata`` (or ``pathlib.PosixPath``), a forged file could rebind its methods for the whole
    process. So a Python class comes as a fresh subclass made for this load (NEWOBJ needs a
    class), and what is only ever called (an Enum, a path class, the layout lookup) as a fresh
    function; types implemented in C (``torch.Size``, ``OrderedDict``, ``set``) and the dtype,
    layout and memory format objects cannot be changed and come as they are.
    """
    import enum
    import pathlib

    if isinstance(found, type) and issubclass(found, (enum.Enum, pathlib.PurePath)):
        def make(*args: Any) -> Any:
            return found(*args)
        return make
    if isinstance(found, type) and found.__module__.startswith("torch.distributed.checkpoint"):
        return type(found.__name__, (found,), {"__module__": found.__module__, "__qualname__": found.__qualname__})
    if found is _layout:
        def layout(name: object) -> Any:
            return _layout(name)
        return layout
    return found


class _Restricted(pickle.Unpickler):
    def __init__(self, data: bytes, where: str) -> None:
        super().__init__(io.BytesIO(data))
        self.where = where
        self.handed: dict[tuple[str, str], Any] = {}  # what this load's find_class gave out, by global

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.handed:
            return self.handed[(module, name)]
        found = admitted(module, name)
        if found is None:
            raise StateError(
                f"{self.where} asks to unpickle {module}.{name}, which is not one of DCP's metadata classes: "
                "unpickling it could run code from storage, so mpckpt refused it (nothing was run). If you "
                "trust whoever wrote this folder, pass allow_pickle=True (mpckpt.load) or --allow-pickle "
                "(mpckpt import-dcp)", key=f"{module}.{name}")
        self.handed[(module, name)] = _fenced(found)
        return self.handed[(module, name)]

    def persistent_load(self, pid: Any) -> Any:
        raise StateError(f"{self.where} holds a persistent id, which DCP's metadata never does; refused "
                         "(nothing was run)")


def read_metadata(data: bytes, *, where: str, allow_pickle: bool = False) -> Any:
    """DCP's ``Metadata`` from the bytes of a ``.metadata`` file (``where`` names it in errors),
    unpickled by the restricted unpickler (``allow_pickle``: plain pickle), shape checked."""
    try:
        metadata = pickle.loads(data) if allow_pickle else _Restricted(data, where).load()
    except StateError:
        raise
    except (RecursionError, MemoryError) as e:
        raise CorruptCheckpointError(f"{where}: cannot be read ({type(e).__name__})", path=where) from e
    except Exception as e:  # any damage: truncated, forged opcodes, wrong arguments to an admitted class
        raise CorruptCheckpointError(f"{where}: not a readable DCP metadata file ({type(e).__name__}: "
                                     f"{str(e)[:300]})", path=where) from e
    try:
        check_metadata(metadata, where=where)
    except (AttributeError, TypeError, ValueError, RecursionError) as e:  # a record built without its fields
        raise CorruptCheckpointError(f"{where}: malformed DCP metadata ({type(e).__name__}: {str(e)[:300]})",
                                     path=where) from e
    return metadata


def check_metadata(md: Any, *, where: str) -> None:
    """``CorruptCheckpointError`` naming ``where`` unless ``md`` has the shape a reader relies on."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: malformed DCP metadata: {what}", path=where)

    def size(value: Any) -> bool:
        return isinstance(value, torch.Size) and all(isinstance(n, int) and n >= 0 for n in value)

    if not isinstance(md, Metadata):
        raise bad(f"holds a {type(md).__name__}, not a Metadata")
    if not isinstance(md.state_dict_metadata, dict) or not isinstance(md.storage_data, dict):
        raise bad("state_dict_metadata and storage_data must be dicts")
    for key, item in md.state_dict_metadata.items():
        if not isinstance(key, str):
            raise bad(f"key {key!r} is not a string")
        if isinstance(item, BytesStorageMetadata):
            continue
        if not isinstance(item, TensorStorageMetadata) or not size(item.size) \
                or not isinstance(getattr(item.properties, "dtype", None), torch.dtype) \
                or not isinstance(item.chunks, list):
            raise bad(f"{key!r} is neither a tensor with a dtype, a size and chunks nor bytes")
        for chunk in item.chunks:
            if not (size(getattr(chunk, "offsets", None)) and size(getattr(chunk, "sizes", None))
                    and len(chunk.offsets) == len(chunk.sizes) == len(item.size)):
                raise bad(f"a chunk of {key!r} does not have the tensor's rank")
    for index, info in md.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(index.fqn, str) \
                or not (index.offset is None or size(index.offset)):
            raise bad(f"storage key {index!r} is not a MetadataIndex")
        if not isinstance(info, _StorageInfo) or not isinstance(info.relative_path, str) \
                or not all(isinstance(n, int) and n >= 0 for n in (info.offset, info.length)):
            raise bad(f"the storage of {index.fqn!r} is not a file, an offset and a length")
        if "/" in info.relative_path or "\\" in info.relative_path or info.relative_path in ("", ".", ".."):
            raise bad(f"the storage of {index.fqn!r} names {info.relative_path!r}, not a file of the folder")
        if getattr(info, "transform_descriptors", None):
            raise bad(f"the storage of {index.fqn!r} is transformed ({info.transform_descriptors!r}); mpckpt "
                      "reads DCP folders written without storage extensions")
    planner = md.planner_data
    if planner is not None and not (isinstance(planner, dict) and all(
            isinstance(k, str) and isinstance(p, tuple) and p and all(
                isinstance(x, str) or (isinstance(x, int) and x >= 0) for x in p) for k, p in planner.items())):
        raise bad("planner_data is not a mapping of keys to state paths")


def write_metadata(metadata: Any) -> bytes:
    """The bytes DCP's ``FileSystemWriter.finish`` writes for ``metadata``."""
    return pickle.dumps(metadata)
