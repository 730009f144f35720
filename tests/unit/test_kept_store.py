"""Publishing a kept snapshot's record: a record that cannot be written takes its new data name
with it, but writing the record of data already in place once more (a pending record with its
checksums) leaves the record and data that were there."""

from __future__ import annotations

import dataclasses
import os
import secrets

import pytest

from mpckpt._keep import store
from mpckpt._keep.record import KeptRecord, Span


@pytest.fixture
def kept(tmp_path):
    url = str(tmp_path / f"root-{secrets.token_hex(4)}")
    s = store.KeptStore(url, 0)
    assert s.hold(quiet=True)
    slab = f"mpckpt-test-slab-{secrets.token_hex(8)}"
    fd = os.open(store.data_path(slab), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, b"\0" * 4096)
    os.close(fd)
    record = KeptRecord(uid=os.geteuid(), root=url, rank=0, world_size=1, step=3, seq=1, data=s.new_data_name(),
                        data_size=4096, created_unix=1.0,
                        spans={"shard-00000.safetensors": Span(b"{}", 0, 4096, None)}, small={"skeleton.json": b"{}"})
    s.publish(record, slab)
    os.unlink(store.data_path(slab))  # (the slab's own name: the data stays reachable through the kept one)
    yield s, record
    s.release(leave=False)


def test_a_record_written_again_that_fails_leaves_the_record_and_data_in_place(kept):
    s, record = kept
    broken = dataclasses.replace(record, metrics={"loss": float("nan")})  # (refused by the JSON writer)
    with pytest.raises(ValueError):
        s.publish_record(broken, again=True)
    found = store.read_kept(s.url, 0, 1)
    assert found is not None and found.record.step == 3 and not found.record.pending  # completed when read
    found.close()
    with pytest.raises(ValueError):
        s.publish_record(broken)  # a first publish that fails: its data name goes with it
    assert not os.path.exists(store.data_path(record.data))
