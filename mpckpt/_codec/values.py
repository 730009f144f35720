"""Values beyond tensors and JSON that a state may hold, stored without pickle, both ways.

Owns the skeleton nodes of numpy arrays and scalars, namedtuples, sets and frozensets, Enum
members, pathlib paths, ``datetime`` values (datetime, date, time, timedelta; time zones
included), dataclass instances, OrderedDicts and ``io.BytesIO`` buffers: ``encode`` on the save path, ``decode`` on the
load path. The flattener (``snapshot``) asks ``encode`` about every value whose type is not one
it stores itself (``PLAIN``), before its own checks, so that subclasses of int, float, str and
dict (IntEnum, ``numpy.float64``, OrderedDict) keep their type.

Nodes (``{"__mpckpt__": tag, ...}``; ``module``/``qualname`` name a class):

    ndarray     dtype (numpy's ``dtype.str``, '<f4'), v: a tensor node (torch.from_numpy)
    npscalar    dtype, v: the value (``[real, imag]`` for complex)
    namedtuple  module, qualname, k: field names, v: values
    dataclass   module, qualname, k: field names, v: values
    enum        module, qualname, name (or value, for a combination of flags)
    set, frozenset   v: elements
    odict       k, v (as ``dict``)
    path        cls (PurePosixPath, PureWindowsPath, PosixPath, WindowsPath), v: the path as text
    datetime, time   v: ISO text without the zone, tz ({offset: [d, s, us], name?} | {zone: key}), fold
    date        v: ISO text;  timedelta   v: [days, seconds, microseconds]
    bytesio     v: the buffer's bytes (base64), pos: its position (an ``io.BytesIO``: DCP's raw bytes items)

Invariants:

- numpy stays optional: saving only looks in ``sys.modules`` (a value cannot be a numpy array
  unless the caller imported numpy); loading imports numpy for a numpy node only.
- A class is recorded by module and qualname, and checked at save to be found again by that
  name. On load the qualname is walked in that module *if the process has already imported
  it*: mpckpt never imports a module a checkpoint names (importing runs the module's top-level
  code, and a skeleton could name any installed module), so a script loads its own classes'
  checkpoints as it is, and anything else imports the module first or passes
  ``classes=False``. What is found must be a class of the recorded kind before it is used, and
  it is used only to look up an Enum member, to build a namedtuple (``_make``; its constructor
  when the fields changed) or a dataclass (``__new__``, then its fields set, as ``copy`` does:
  ``__init__`` is not run; a field added since gets its default). Nothing from storage is run.
- ``check_only`` (``mpckpt verify``) checks every node and imports nothing.
- ``classes=False`` gives namedtuples and dataclasses as dicts of their fields and Enum members
  as their names (values for flag combinations), importing nothing: how to read a checkpoint
  whose classes are gone.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import datetime as dt
import enum
import io
import pathlib
import re
import sys
from collections.abc import Callable
from typing import Any, Protocol

import torch

from mpckpt.errors import StateError

TAG = "__mpckpt__"  # the key that marks a tagged node in a skeleton tree

# types the flattener stores itself: never asked about here
PLAIN = frozenset({type(None), bool, int, float, str, bytes, bytearray, dict, list, tuple,
                   torch.dtype, torch.Size, torch.device})
TAGS = frozenset({"ndarray", "npscalar", "namedtuple", "dataclass", "enum", "set", "frozenset", "odict", "path",
                  "datetime", "date", "time", "timedelta", "bytesio"})

# numpy dtype (without its byte order) -> the tensor dtype that holds it
_NUMPY_TENSOR = {
    "b1": torch.bool, "u1": torch.uint8, "i1": torch.int8, "i2": torch.int16, "i4": torch.int32, "i8": torch.int64,
    "u2": torch.uint16, "u4": torch.uint32, "u8": torch.uint64, "f2": torch.float16, "f4": torch.float32,
    "f8": torch.float64, "c8": torch.complex64, "c16": torch.complex128,
}
_NUMPY_CODE = re.compile(r"[<>|]([biufc]\d+|[US]\d+)")
_MODULE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
_PATHS = {c.__name__: c for c in (pathlib.PurePosixPath, pathlib.PureWindowsPath, pathlib.PosixPath, pathlib.WindowsPath)}
_PURE = {"PosixPath": pathlib.PurePosixPath, "WindowsPath": pathlib.PureWindowsPath}
CONVERT = "int() / float() / str(), dataclasses.asdict(), .tolist()"  # what refusals suggest


class Visitor(Protocol):
    """What ``encode`` needs of the flattener."""

    allow_pickle: bool
    made: dict[int, Any]  # id(value) -> what was made from it for this save (kept alive meanwhile)

    def visit(self, value: Any, path: str) -> Any: ...

    def container(self, value: Any, path: str, fn: Any) -> Any: ...

    def mapping(self, value: dict, path: str) -> dict[str, Any]: ...

    def refuse(self, path: str, what: str, hint: str) -> None: ...


def path_of(parent: str, key: Any) -> str:
    """The dotted key path of ``key`` under ``parent`` (how errors and leaf names spell it)."""
    return f"{parent}.{key}" if parent else str(key)


def _refuse(f: Visitor, path: str, what: str, hint: str) -> Any:
    """``NotImplemented`` when pickle is allowed (the flattener pickles the value); else the
    value is noted as refused (the walk goes on, so that one error names every such key)."""
    if f.allow_pickle:
        return NotImplemented
    f.refuse(path, what, hint)
    return None


# -- saving ------------------------------------------------------------------------------------

def encode(f: Visitor, value: Any, path: str) -> Any:
    """The skeleton node of ``value``, or ``NotImplemented`` when it is none of this module's
    types (objects with ``state_dict()`` included: the flattener stores what that returns)."""
    if isinstance(value, type) or callable(getattr(value, "state_dict", None)):
        return NotImplemented
    np = sys.modules.get("numpy")
    if np is not None and isinstance(value, (np.ndarray, np.generic)):
        return _numpy(f, np, value, path)
    kind = type(value)
    if isinstance(value, enum.Enum):
        return _enum(f, value, path)
    if kind is collections.OrderedDict:
        return {**f.container(value, path, f.mapping), TAG: "odict"}
    if isinstance(value, tuple) and hasattr(kind, "_fields") and hasattr(kind, "_make"):
        return _fields(f, value, path, "namedtuple", list(kind._fields), list(value))
    if kind is set or kind is frozenset:
        return f.container(value, path, lambda v, p: {
            TAG: kind.__name__, "v": [f.visit(x, path_of(p, i)) for i, x in enumerate(v)]})
    if kind in _PATHS.values():
        return {TAG: "path", "cls": kind.__name__, "v": str(value)}
    if kind is io.BytesIO:
        return {TAG: "bytesio", "v": base64.b64encode(value.getbuffer()).decode(), "pos": value.tell()}
    if kind is dt.timedelta:
        return {TAG: "timedelta", "v": [value.days, value.seconds, value.microseconds]}
    if kind is dt.date:
        return {TAG: "date", "v": value.isoformat()}
    if kind is dt.datetime or kind is dt.time:
        return _clock(f, value, path)
    if dataclasses.is_dataclass(value):
        names = [x.name for x in dataclasses.fields(value) if hasattr(value, x.name)]  # an init=False field may be unset
        return _fields(f, value, path, "dataclass", names, [getattr(value, n) for n in names])
    return NotImplemented


def _numpy(f: Visitor, np: Any, value: Any, path: str) -> Any:
    code = value.dtype.str  # '<f4': kind, size and byte order
    if isinstance(value, np.generic):
        if not _NUMPY_CODE.fullmatch(code) or (code[1:] not in _NUMPY_TENSOR and code[1] not in "US"):
            return _refuse(f, path, f"a numpy scalar of dtype {value.dtype}", "convert it with .item() or int() / float()")
        item = value.item()
        v = [f.visit(item.real, path), f.visit(item.imag, path)] if isinstance(item, complex) else f.visit(item, path)
        return {TAG: "npscalar", "dtype": code, "v": v}
    if type(value) is not np.ndarray:
        return _refuse(f, path, f"a {type(value).__module__}.{type(value).__qualname__} (a numpy array subclass)",
                       "convert it with numpy.asarray()")
    if code[1:] not in _NUMPY_TENSOR:
        return _refuse(f, path, f"a numpy array of dtype {value.dtype}",
                       "convert it with .tolist() or .astype() to a numeric dtype")
    tensor = f.made.get(id(value))
    if tensor is None:
        arr = value if value.dtype.isnative else value.astype(value.dtype.newbyteorder("="))
        if not arr.flags.writeable:
            arr = arr.copy()  # torch.from_numpy warns about read-only memory; mpckpt only reads it
        try:
            tensor = torch.from_numpy(arr)
        except ValueError:  # negative strides, or strides that are not whole elements
            tensor = torch.from_numpy(np.ascontiguousarray(arr))
        f.made[id(value)] = tensor  # the same array again is the same tensor: one row, shared on load
    return {TAG: "ndarray", "dtype": code, "v": f.visit(tensor, path)}


def _class(f: Visitor, cls: type, path: str, what: str) -> dict[str, str] | None:
    """``module``/``qualname`` of ``cls``, or None when that name does not lead back to it."""
    module, qualname = cls.__module__, cls.__qualname__
    found: Any = sys.modules.get(module)
    for part in qualname.split("."):
        found = getattr(found, part, None)
    if "<locals>" in qualname or found is not cls:
        _refuse(f, path, f"{what} of class {module}.{qualname}, which cannot be found again by that name "
                "(a class defined inside a function, or renamed)",
                f"define the class at module level, or convert the value ({CONVERT})")
        return None  # pickle is allowed: the flattener pickles it
    return {"module": module, "qualname": qualname}


def _fields(f: Visitor, value: Any, path: str, tag: str, names: list[str], items: list[Any]) -> Any:
    ref = _class(f, type(value), path, f"a {tag}")
    if ref is None:
        return NotImplemented
    return f.container(value, path, lambda v, p: {
        TAG: tag, **ref, "k": names, "v": [f.visit(x, path_of(p, n)) for n, x in zip(names, items, strict=True)]})


def _enum(f: Visitor, value: enum.Enum, path: str) -> Any:
    ref = _class(f, type(value), path, "an Enum member")
    if ref is None:
        return NotImplemented
    if value.name is not None and type(value).__members__.get(value.name) is value:
        return {TAG: "enum", **ref, "name": value.name}
    return {TAG: "enum", **ref, "value": f.visit(value.value, path)}  # a combination of flags


def _clock(f: Visitor, value: dt.datetime | dt.time, path: str) -> Any:
    node: dict[str, Any] = {TAG: type(value).__name__, "v": value.replace(tzinfo=None, fold=0).isoformat()}
    tz = value.tzinfo
    zoneinfo = sys.modules.get("zoneinfo")  # a value cannot hold a ZoneInfo unless zoneinfo is imported
    key = getattr(tz, "key", None)  # a ZoneInfo's name (None for one made from a file)
    if isinstance(tz, dt.timezone):
        offset = tz.utcoffset(None)
        node["tz"] = {"offset": [offset.days, offset.seconds, offset.microseconds]}
        if tz.tzname(None) != dt.timezone(offset).tzname(None):
            node["tz"]["name"] = tz.tzname(None)
    elif zoneinfo is not None and type(tz) is zoneinfo.ZoneInfo and isinstance(key, str):
        node["tz"] = {"zone": key}
    elif tz is not None:
        return _refuse(f, path, f"a {type(value).__name__} with the time zone {tz!r} ({type(tz).__name__})",
                       "use datetime.timezone or zoneinfo.ZoneInfo (e.g. .astimezone(datetime.timezone.utc))")
    if value.fold:
        node["fold"] = 1
    return node


# -- loading -----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Reader:
    """How ``decode`` reads: ``child(node, path)`` decodes a nested node."""

    child: Callable[[Any, str], Any]
    check_only: bool = False
    classes: bool = True


def decode(node: dict[str, Any], tag: str, path: str, r: Reader) -> Any:
    """The value of a node with one of ``TAGS``. A malformed node raises KeyError, TypeError or
    ValueError (the caller reports damage); what this machine lacks raises ``StateError``."""
    if tag in ("set", "frozenset", "odict"):
        if tag == "odict":
            return collections.OrderedDict(
                (k, r.child(v, path_of(path, k))) for k, v in zip(node["k"], node["v"], strict=True))
        items = [r.child(x, path_of(path, i)) for i, x in enumerate(_list(node["v"]))]
        return set(items) if tag == "set" else frozenset(items)
    if tag in ("namedtuple", "dataclass", "enum"):
        return _decode_class(node, tag, path, r)
    if tag in ("ndarray", "npscalar"):
        return _decode_numpy(node, tag, path, r)
    if tag == "path":
        name, text = node["cls"], _str(node["v"])
        try:
            return _PATHS[name](text)
        except NotImplementedError:  # WindowsPath on POSIX and the reverse: the pure class holds it
            return _PURE[name](text)
    if tag == "bytesio":
        buffer = io.BytesIO(base64.b64decode(_str(node["v"]), validate=True))
        buffer.seek(_ints([node["pos"]], 1)[0])
        return buffer
    if tag == "timedelta":
        days, seconds, micro = _ints(node["v"], 3)
        return dt.timedelta(days=days, seconds=seconds, microseconds=micro)
    if tag == "date":
        return dt.date.fromisoformat(_str(node["v"]))
    value = (dt.datetime if tag == "datetime" else dt.time).fromisoformat(_str(node["v"]))
    fold = node.get("fold", 0)
    if value.tzinfo is not None or fold not in (0, 1) or isinstance(fold, bool):
        raise ValueError("a zone inside the ISO text, or a fold that is not 0 or 1")
    return value.replace(tzinfo=_zone(node.get("tz"), path, r), fold=fold)


def _list(x: Any) -> list[Any]:
    if not isinstance(x, list):
        raise TypeError(f"{str(x)[:40]!r} is not a list")
    return x


def _str(x: Any) -> str:
    if not isinstance(x, str):
        raise TypeError(f"{str(x)[:40]!r} is not a string")
    return x


def _ints(x: Any, n: int) -> list[int]:
    if not isinstance(x, list) or len(x) != n or not all(isinstance(i, int) and not isinstance(i, bool) for i in x):
        raise TypeError(f"{str(x)[:40]!r} is not a list of {n} integers")
    return x


def _zone(node: Any, path: str, r: Reader) -> dt.tzinfo | None:
    if node is None:
        return None
    if "offset" in node:
        offset = dt.timedelta(*_ints(node["offset"], 3))
        return dt.timezone(offset, _str(node["name"])) if "name" in node else dt.timezone(offset)
    key = _str(node["zone"])
    if r.check_only:
        return None
    import zoneinfo

    try:
        return zoneinfo.ZoneInfo(key)
    except zoneinfo.ZoneInfoNotFoundError as e:
        raise StateError(f"state key {path or '<root>'!r} holds a time in the zone {key!r}, which this machine does "
                         "not know; install the tzdata package", key=path) from e


def _decode_numpy(node: dict[str, Any], tag: str, path: str, r: Reader) -> Any:
    code = _str(node["dtype"])
    if not _NUMPY_CODE.fullmatch(code) or (tag == "ndarray" or code[1] not in "US") and code[1:] not in _NUMPY_TENSOR:
        raise ValueError(f"numpy dtype {code[:20]!r} is not one mpckpt stores")
    if tag == "ndarray":
        tensor = r.child(node["v"], path)
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != _NUMPY_TENSOR[code[1:]]:
            raise ValueError(f"a numpy array of dtype {code} is not held by a tensor of {_NUMPY_TENSOR[code[1:]]}")
        if r.check_only:
            return tensor
        _import_numpy(path)
        arr = tensor.numpy()  # shares the loaded tensor's memory
        return arr if arr.dtype.str == code else arr.astype(code)
    v = node["v"]
    value = complex(r.child(v[0], path), r.child(v[1], path)) if code[1] == "c" else r.child(v, path)
    if r.check_only:
        return value
    return _import_numpy(path).dtype(code).type(value)


def _import_numpy(path: str) -> Any:
    try:
        import numpy
    except ImportError as e:
        raise StateError(f"state key {path or '<root>'!r} holds a numpy value and numpy is not installed here; "
                         "install numpy to load this checkpoint", key=path) from e
    return numpy


_KINDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "namedtuple": ("a namedtuple", lambda c: issubclass(c, tuple) and hasattr(c, "_make") and hasattr(c, "_fields")),
    "dataclass": ("a dataclass instance", dataclasses.is_dataclass),
    "enum": ("an Enum member", lambda c: issubclass(c, enum.Enum)),
}


def _decode_class(node: dict[str, Any], tag: str, path: str, r: Reader) -> Any:
    module, qualname = _str(node["module"]), _str(node["qualname"])
    if not _MODULE.fullmatch(module) or not _MODULE.fullmatch(qualname):
        raise ValueError(f"{module[:80]}.{qualname[:80]} is not the name of a class")
    if tag == "enum":
        name = _str(node["name"]) if "name" in node else None
        value = r.child(node["value"], path) if name is None else None
        if r.check_only or not r.classes:
            return name if name is not None else value
    else:
        names = [_str(k) for k in _list(node["k"])]
        if len(set(names)) != len(names):
            raise ValueError("a field name repeats")
        items = [r.child(x, path_of(path, n)) for n, x in zip(names, _list(node["v"]), strict=True)]
        if r.check_only or not r.classes:
            return dict(zip(names, items, strict=True))
    what, kind_ok = _KINDS[tag]
    cls = _find_class(module, qualname, path, what, kind_ok)
    where = f"state key {path or '<root>'!r}: {module}.{qualname}"
    if tag == "enum":
        member = cls.__members__.get(name) if name is not None else None
        try:
            return member if member is not None else cls(value)
        except ValueError as e:
            raise StateError(f"{where} has no member {name or value!r} now; add it back, or load the checkpoint with "
                             "mpckpt.load(root, step, classes=False), which gives the member's name, and convert",
                             key=path) from e
    if tag == "namedtuple":
        if tuple(names) == tuple(cls._fields):
            return cls._make(items)
        try:
            return cls(**dict(zip(names, items, strict=True)))
        except TypeError as e:
            raise StateError(f"{where} has the fields {list(cls._fields)} now, the checkpoint has {names}; "
                             "load it with mpckpt.load(root, step, classes=False) and convert", key=path) from e
    return _dataclass(cls, names, items, path, where)


def _find_class(module: str, qualname: str, path: str, what: str, kind_ok: Callable[[Any], bool]) -> Any:
    cause: BaseException | None = None
    found: Any = None
    try:
        found = sys.modules.get(module)
        if found is None:
            raise LookupError(f"module {module} is not imported in this process, and mpckpt imports no module "
                              f"a checkpoint names: `import {module}` before loading")
        for part in qualname.split("."):
            found = getattr(found, part)
    except Exception as e:  # whatever importing the module raises: the class cannot be had
        cause, found = e, None
    if not isinstance(found, type) or not kind_ok(found):
        why = f"{type(cause).__name__}: {cause}" if cause is not None else f"that name now holds {str(found)[:80]}"
        raise StateError(
            f"state key {path or '<root>'!r} holds {what} of class {module}.{qualname}, which cannot be found now "
            f"({why}); keep the class importable under that name, or load the checkpoint with "
            "mpckpt.load(root, step, classes=False), which gives namedtuples and dataclasses as dicts of their "
            "fields and Enum members as their names without importing anything, and convert", key=path) from cause
    return found


def _dataclass(cls: Any, names: list[str], items: list[Any], path: str, where: str) -> Any:
    fields = {x.name: x for x in dataclasses.fields(cls)}
    gone = [n for n in names if n not in fields]
    needed = [x.name for x in fields.values() if x.name not in names and x.init
              and x.default is dataclasses.MISSING and x.default_factory is dataclasses.MISSING]
    if gone or needed:
        changes = ([f"no field {', '.join(gone)} now"] if gone else []) + (
            [f"a new field {', '.join(needed)} without a default"] if needed else [])
        raise StateError(f"{where} has {' and '.join(changes)}; give new fields defaults, or load the checkpoint with "
                         "mpckpt.load(root, step, classes=False), which gives the fields as a dict, and convert",
                         key=path)
    obj = cls.__new__(cls)
    for name, item in zip(names, items, strict=True):
        object.__setattr__(obj, name, item)  # frozen dataclasses too, as their __init__ does
    for x in fields.values():
        if x.name not in names and x.default is not dataclasses.MISSING:
            object.__setattr__(obj, x.name, x.default)
        elif x.name not in names and x.default_factory is not dataclasses.MISSING:
            object.__setattr__(obj, x.name, x.default_factory())
    return obj
