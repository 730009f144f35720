"""A kept snapshot's record is joined from parts (the base64 made once, the JSON around it): its
bytes are exactly those of dumping the whole record plainly, and it reads back."""

from __future__ import annotations

import base64
import dataclasses
import json

import pytest

from mpckpt._keep.digest import with_checksums
from mpckpt._keep.record import UNKNOWN, KeptRecord, Span
from mpckpt.errors import CorruptCheckpointError
from mpckpt.format.checksums import file_checksums
from mpckpt.format.manifest import checksum


def record(skeleton: bytes, metrics: dict) -> KeptRecord:
    spans = {f"shard-{i:05d}.safetensors": Span(b'{"w":{"dtype":"F32"}}' * (i + 1), 4096 * i, 100 + i,
                                                f"{i:016x}", tuple(f"{j:016x}" for j in range(i)))
             for i in range(3)}
    return KeptRecord(uid=1000, root="s3://bucket/run \u00e9", rank=1, world_size=2, step=7, seq=3, data="mpckpt-kept-x",
                      data_size=1 << 20, created_unix=1795724949.5, spans=spans, small={"skeleton.json": skeleton},
                      metrics=metrics)


def plain(r: KeptRecord) -> bytes:
    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode()

    body = {"format": "mpckpt-kept", "version": 2, "uid": r.uid, "root": r.root, "rank": r.rank,
            "world_size": r.world_size, "step": r.step, "seq": r.seq, "data": r.data, "data_size": r.data_size,
            "created_unix": r.created_unix, "metrics": r.metrics,
            "spans": {rel: {"header": b64(s.header), "offset": s.offset, "nbytes": s.nbytes, "xxh3_64": s.checksum,
                            "blocks": list(s.blocks)} for rel, s in r.spans.items()},
            "small": {rel: b64(d) for rel, d in r.small.items()}}
    body["record_checksum"] = checksum(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


@pytest.mark.parametrize("size", [0, 10, 5000, 3 << 20])
def test_the_joined_record_is_the_plain_dump_and_reads_back(size: int) -> None:
    skeleton = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    metrics = {"loss": 0.25, "note": 'a "quoted" mpckpt-b64- text', "nested": {"b": [1, 2]}}
    r = record(skeleton, metrics)
    data = r.to_bytes()
    assert data == plain(r)
    assert r.to_bytes() == data  # again, with the base64 made before
    back = KeptRecord.from_bytes(data, path="/dev/shm/x.record")
    assert back.small == r.small and back.spans == r.spans and back.metrics == metrics


def test_an_edited_record_is_refused() -> None:
    data = record(b"skeleton", {"loss": 1.0}).to_bytes()
    with pytest.raises(CorruptCheckpointError):
        KeptRecord.from_bytes(data.replace(b'"step":7', b'"step":8'), path="/dev/shm/x.record")


def single(checksums: list[str | None]) -> KeptRecord:
    spans = {f"shard-{i:05d}.safetensors": Span(b'{"w":{}}' + bytes([i]), 1000 * i, 1000, c)
             for i, c in enumerate(checksums)}
    return KeptRecord(uid=1000, root="/ckpt", rank=0, world_size=1, step=9, seq=4, data="mpckpt-kept-x",
                      data_size=4000, created_unix=1.0, spans=spans, small={"skeleton.json": b"{}"})


def test_a_single_process_record_may_be_published_before_its_checksums() -> None:
    r = single([None, "00000000000000ab"])
    assert r.pending and b'"xxh3_64":null' in r.to_bytes()
    back = KeptRecord.from_bytes(r.to_bytes(), path="/dev/shm/x.record")
    assert back.spans == r.spans and back.pending
    files = back.manifest().files  # a checksum it does not have is listed as unknown, never made up
    assert files["shard-00000.safetensors"].checksum == UNKNOWN
    assert files["shard-00001.safetensors"].checksum == "00000000000000ab"


def test_a_pending_record_is_completed_with_the_checksums_given() -> None:
    data = bytes(range(256)) * 16  # 4,096 bytes: four files of 1,000
    r = single([None, None, "stale-is-kept-as-is", None])
    done = with_checksums(r, {rel: file_checksums(span.header, memoryview(data)[span.offset:span.offset + span.nbytes], 0)[0]
                              for rel, span in r.spans.items() if span.checksum is None})
    assert not done.pending
    for rel, span in done.spans.items():
        want = file_checksums(span.header, memoryview(data)[span.offset:span.offset + span.nbytes], 0)[0]
        assert span.checksum == ("stale-is-kept-as-is" if rel.endswith("00002.safetensors") else want)
    assert done.manifest().files["shard-00000.safetensors"].size == len(r.spans["shard-00000.safetensors"].header) + 1000


def test_a_rank_record_without_its_checksums_is_refused() -> None:
    r = record(b"skeleton", {})
    spans = {rel: Span(s.header, s.offset, s.nbytes, None, s.blocks) for rel, s in r.spans.items()}
    data = dataclasses.replace(r, spans=spans).to_bytes()
    with pytest.raises(CorruptCheckpointError, match="without its checksums"):
        KeptRecord.from_bytes(data, path="/dev/shm/x.record")


def test_a_checksum_of_another_type_is_refused() -> None:
    data = single(["00000000000000ab"]).to_bytes().replace(b'"00000000000000ab"', b"12")
    body = json.loads(data)
    body.pop("record_checksum")
    body["record_checksum"] = checksum(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    with pytest.raises(CorruptCheckpointError, match="has checksum '12'"):
        KeptRecord.from_bytes(json.dumps(body, sort_keys=True, separators=(",", ":")).encode(), path="/dev/shm/x")
