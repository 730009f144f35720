"""Build and parse safetensors headers without the safetensors package or torch.

A safetensors file is: 8 bytes little-endian header length N, N bytes of JSON (padded with
spaces to a multiple of 8), then the tensor bytes. Each JSON entry names a dtype, a shape and
``data_offsets`` relative to the end of the header; together they must cover the data with
no holes or overlaps. ``__metadata__`` maps strings to strings.

mpckpt writes the header in the training process and the data straight from shared memory in
an uploader, so the two are produced separately; ``parse_header`` re-checks everything a
hostile or damaged file could lie about before a byte of data is trusted.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass

from mpckpt.errors import CorruptCheckpointError

ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E4M3FNUZ": 1, "F8_E5M2FNUZ": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit


@dataclass(frozen=True)
class HeaderEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # relative to the data section
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def build_header(entries: list[HeaderEntry], metadata: dict[str, str] | None = None, *, align: int = 8) -> bytes:
    """The 8-byte length plus the JSON header for ``entries`` (in data order).

    The JSON is padded with spaces so the whole header is a multiple of ``align`` bytes
    (a multiple of 8); mpckpt uses 4096 so the tensor data starts on a disk block, which lets
    the local backend write it with direct I/O.
    """
    doc: dict[str, object] = {}
    if metadata:
        doc["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for e in entries:
        doc[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [e.start, e.end]}
    text = json.dumps(doc, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + 8) % align)
    return struct.pack("<Q", len(text)) + text


@dataclass(frozen=True)
class ParsedHeader:
    header_len: int  # bytes before the data section (8 + JSON)
    entries: dict[str, HeaderEntry]
    metadata: dict[str, str]

    @property
    def data_bytes(self) -> int:
        return max((e.end for e in self.entries.values()), default=0)


def header_length(prefix: bytes, *, path: str, file_size: int) -> int:
    """The JSON length from the first 8 bytes, checked against the file size."""
    if len(prefix) < 8:
        raise CorruptCheckpointError(f"{path}: shorter than a safetensors header (8 bytes)", path=path)
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER_BYTES or 8 + n > file_size:
        raise CorruptCheckpointError(
            f"{path}: safetensors header claims {n} bytes, file has {file_size}; the file is damaged", path=path
        )
    return n


def parse_header(raw: bytes, *, path: str, file_size: int) -> ParsedHeader:
    """Parse and validate a header (``raw`` starts at byte 0 and holds at least the header)."""
    n = header_length(raw, path=path, file_size=file_size)
    try:
        doc = json.loads(raw[8:8 + n])
    except (ValueError, RecursionError) as e:  # also too-deep nesting, too-long integers
        raise CorruptCheckpointError(f"{path}: safetensors header is not valid JSON ({e})", path=path) from e
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{path}: safetensors header is not a JSON object", path=path)
    metadata = doc.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CorruptCheckpointError(f"{path}: __metadata__ must map strings to strings", path=path)
    data_size = file_size - 8 - n
    entries: dict[str, HeaderEntry] = {}
    for name, info in doc.items():
        entries[name] = _check_entry(name, info, path=path, data_size=data_size)
    spans = sorted((e.start, e.end, e.name) for e in entries.values())
    pos = 0
    for start, end, name in spans:
        if start != pos:
            raise CorruptCheckpointError(f"{path}: tensor {name!r} leaves a hole or overlaps at byte {start}", path=path)
        pos = end
    if pos != data_size:
        raise CorruptCheckpointError(f"{path}: tensors cover {pos} bytes but the data section has {data_size}", path=path)
    return ParsedHeader(8 + n, entries, dict(metadata))


def _check_entry(name: str, info: object, *, path: str, data_size: int) -> HeaderEntry:
    if not isinstance(info, dict):
        raise CorruptCheckpointError(f"{path}: entry {name!r} is not an object", path=path)
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in ITEMSIZE:
        raise CorruptCheckpointError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}", path=path)
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise CorruptCheckpointError(f"{path}: tensor {name!r} has a bad shape {shape!r}", path=path)
    if (
        not isinstance(offsets, list) or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= data_size
    ):
        raise CorruptCheckpointError(
            f"{path}: tensor {name!r} has data_offsets {offsets!r} outside the {data_size}-byte data section", path=path
        )
    expected = math.prod(shape) * ITEMSIZE[dtype]
    if offsets[1] - offsets[0] != expected:
        raise CorruptCheckpointError(
            f"{path}: tensor {name!r} spans {offsets[1] - offsets[0]} bytes but {dtype}{shape} needs {expected}",
            path=path,
        )
    return HeaderEntry(name, dtype, tuple(shape), offsets[0], offsets[1])
