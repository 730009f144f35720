"""What a snapshot kept in shared memory holds: the record beside its bytes (``mpckpt-kept`` v2).

A kept snapshot is two files in /dev/shm (``store``): its data (a slab: each shard file's
data at an offset) and this record, JSON, written after the last byte of the data was copied
and put in place with one rename: a record exists only for a complete snapshot.
It says whose it is (user, root URL, rank of a world size), which step and save sequence it
holds, and every file the checkpoint would have on storage: the skeleton's bytes themselves,
and for each shard its safetensors header, where its data sits in the slab, its size and
xxh3-64 (the manifest's checksum of that file, the very value storage gets), and in a
multi-rank save its block checksums. A canonical-text checksum covers the record, as the
manifest's does, so a torn or edited record is refused, never trusted.

A single process's record may be published before its shard files' checksums (``null``): an
eager save puts it in place as soon as the copy is complete, so a kill right after ``save()``
returns loses nothing; the checksums are added once its uploads (which compute them) are done,
and the record published again with them (``_keep.keeper``). A record still pending when its process died is
completed by the restore that reads it (``source.MemorySource.learn``: the checksums its reads
compute as they verify everything else): nothing writes a kept slab while its record exists, so
those are the bytes the save copied, and hashing them at open would only have delayed the open. A rank's record (its skeleton
lists its block checksums) is never pending.

``manifest()`` is the checkpoint's manifest as a memory source presents it: a restore checks
every byte read from memory against it (``_read.verified``), as it checks storage.
"""
from __future__ import annotations

import base64
import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from mpckpt.errors import CorruptCheckpointError
from mpckpt.format import checksums
from mpckpt.format.manifest import FileEntry, Manifest, checksum, format_version_for
from mpckpt.format.names import check_relpath

FORMAT = "mpckpt-kept"
VERSION = 2  # 2: a single process's shard checksums may be pending (null)
UNKNOWN = ""  # a pending file's checksum in a manifest: the restore that reads it computes it (``source.learn``)
MAX_RECORD_BYTES = 256 << 20  # a skeleton is at most 64 MiB (format.skeleton), base64 and a few entries on top


@dataclass(frozen=True)
class Span:
    """One shard file of a kept snapshot: its header, and where its data sits in the slab."""

    header: bytes
    offset: int   # of its data in the slab
    nbytes: int   # of its data
    checksum: str | None  # xxh3-64 of header + data: the manifest's checksum of the file (None: pending)
    blocks: tuple[str, ...] = ()  # xxh3-64 of every block of the file (a multi-rank save's)

    @property
    def size(self) -> int:
        return len(self.header) + self.nbytes


@dataclass(frozen=True)
class KeptRecord:
    """One complete snapshot kept in shared memory (see the module docstring)."""

    uid: int
    root: str
    rank: int
    world_size: int
    step: int
    seq: int          # the save's sequence number (-1: a memory-only save, never on storage)
    data: str         # the name of its data file in /dev/shm
    data_size: int
    created_unix: float
    spans: dict[str, Span] = field(default_factory=dict)   # shard files
    small: dict[str, bytes] = field(default_factory=dict)  # files held whole (the skeleton)
    metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def ranked(self) -> bool:
        return self.world_size > 1

    @property
    def pending(self) -> bool:
        """Some shard file's checksum is still being computed (see the module docstring)."""
        return any(span.checksum is None for span in self.spans.values())

    def file_entries(self) -> dict[str, FileEntry]:
        """Every file of the checkpoint, with its size and checksum (``UNKNOWN`` for a pending one's)."""
        files = {}
        for rel, span in self.spans.items():
            files[rel] = FileEntry(span.size, UNKNOWN if span.checksum is None else span.checksum)
        files.update({rel: FileEntry(len(data), checksum(data)) for rel, data in self.small.items()})
        return files

    def manifest(self) -> Manifest:
        """The manifest of the checkpoint this record holds (a single process's)."""
        return state_manifest(self.step, self.seq, self.file_entries(), metrics=self.metrics,
                              created_unix=self.created_unix, world_size=self.world_size)

    def to_bytes(self) -> bytes:
        return b"".join(self.to_pieces())

    def to_pieces(self) -> list[bytes]:
        """The record's bytes in pieces, whose concatenation is ``to_bytes()`` (written as they are,
        with one ``writev``: neither joined nor copied for the checksum)."""
        # The base64 of the skeleton and of the shards' headers is most of a record (MiBs for
        # thousands of tensors; tens of MiB for 100,000) and the JSON encoder scans a long string
        # slowly: both texts are dumped with a short stand-in for each, and the record's bytes are
        # taken from the JSON around the stand-ins and the base64 bytes (made once per bytes
        # object: ``_base64``), never held as one long str. Base64 needs no escaping: the bytes are
        # those of dumping it.
        token = secrets.token_hex(8)
        texts: list[bytes] = []

        def stand_in(data: bytes) -> str:
            texts.append(_base64(data))
            return f"mpckpt-b64-{token}-{len(texts) - 1}"

        body = {
            "format": FORMAT, "version": VERSION, "uid": self.uid, "root": self.root, "rank": self.rank,
            "world_size": self.world_size, "step": self.step, "seq": self.seq, "data": self.data,
            "data_size": self.data_size, "created_unix": self.created_unix, "metrics": self.metrics,
            "spans": {rel: {"header": stand_in(s.header), "offset": s.offset, "nbytes": s.nbytes,
                            "xxh3_64": s.checksum, "blocks": list(s.blocks)} for rel, s in sorted(self.spans.items())},
            "small": {rel: stand_in(data) for rel, data in sorted(self.small.items())},
        }
        marker = f'"mpckpt-b64-{token}-'

        def spliced(text: str) -> list[bytes]:
            pieces = text.split(marker)
            assert len(pieces) == len(texts) + 1, "each stand-in appears once"
            out = [pieces[0].encode()]
            for piece in pieces[1:]:
                index, quote, rest = piece.partition('"')
                assert quote, "a stand-in is a whole JSON string"
                out += [b'"', texts[int(index)], b'"', rest.encode()]
            return out

        hasher = checksums.hasher()
        for piece in spliced(json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)):
            hasher.update(piece)
        body["record_checksum"] = hasher.hexdigest()
        return spliced(json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False))

    @classmethod
    def from_bytes(cls, data: bytes, *, path: str) -> KeptRecord:
        """The record in ``data``; ``CorruptCheckpointError`` naming ``path`` for anything else."""
        try:
            body = json.loads(data)
            if not isinstance(body, dict) or body.get("format") != FORMAT or body.get("version") != VERSION:
                raise ValueError(f"not an {FORMAT} record of version {VERSION}")
            claimed = body.pop("record_checksum", None)
            if claimed != checksum(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()):
                raise ValueError("its checksum does not match its content (torn or edited)")
            spans = {}
            for rel, s in body["spans"].items():
                check_relpath(rel)
                digest = s["xxh3_64"]
                if not (digest is None or isinstance(digest, str)):
                    raise ValueError(f"file {rel!r} has checksum {str(digest)[:40]!r}")
                spans[rel] = Span(base64.b64decode(s["header"], validate=True), _count(s["offset"]),
                                  _count(s["nbytes"]), digest, tuple(str(b) for b in s["blocks"]))
            small = {}
            for rel, text in body["small"].items():
                check_relpath(rel)
                small[rel] = base64.b64decode(text, validate=True)
            record = cls(uid=_count(body["uid"]), root=str(body["root"]), rank=_count(body["rank"]),
                         world_size=_count(body["world_size"]), step=_count(body["step"]), seq=int(body["seq"]),
                         data=str(body["data"]), data_size=_count(body["data_size"]),
                         created_unix=float(body["created_unix"]), spans=spans, small=small,
                         metrics=dict(body.get("metrics") or {}))
            for rel, span in spans.items():
                if span.offset + span.nbytes > record.data_size:
                    raise ValueError(f"file {rel!r} lies past the end of its data ({record.data_size} bytes)")
            if record.world_size < 1 or record.rank >= record.world_size:
                raise ValueError(f"rank {record.rank} of a world of {record.world_size}")
            if record.ranked and record.pending:
                raise ValueError("a rank's record without its checksums (only a single process's may be pending)")
            return record
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError, OverflowError) as e:
            raise CorruptCheckpointError(f"{path}: not a usable record of a kept snapshot ({str(e)[:200]})",
                                         path=path) from e


_base64_made: dict[int, tuple[bytes, bytes]] = {}  # id -> (bytes, their base64): the last record's


def _base64(data: bytes) -> bytes:
    """``data`` in base64; made again only for other bytes objects than the last record's (a
    repeated save of an unchanged state shape hands out the very skeleton and headers it made)."""
    made = _base64_made.get(id(data))
    if made is not None and made[0] is data:
        return made[1]
    text = base64.b64encode(data)
    if len(data) > 1024:
        if len(_base64_made) > 256:
            _base64_made.clear()
        _base64_made[id(data)] = (data, text)
    return text


def state_manifest(step: int, seq: int, files: dict[str, FileEntry], *, metrics: dict[str, Any],
                   created_unix: float, world_size: int) -> Manifest:
    """The manifest a memory source presents for a state saved as ``files`` (``seq`` -1: memory only)."""
    return Manifest(step=step, seq=max(seq, 0), kind="state", files=files, metrics=dict(metrics),
                    created_unix=created_unix, world_size=world_size,
                    format_version=format_version_for("state", files, ranked=world_size > 1))


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{str(value)[:40]!r} is not a non-negative integer")
    return value
