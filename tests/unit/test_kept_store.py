"""Publishing a kept snapshot's record: a record that cannot be written takes its new data name
with it, but writing the record of data already in place once more (a pending record with its
checksums) leaves the record and data that were there. Several steps are kept side by side,
each a record named by its step and its data; dropping one leaves the others; what no checked
record lists is tidied away at open; a record under another step's name is refused."""

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
    [found] = store.read_kept(s.url, 0, 1)
    assert found.record.step == 3 and found.record.pending  # as it was (the restore that reads it completes it)
    found.close()
    with pytest.raises(ValueError):
        s.publish_record(broken)  # a first publish that fails: its data name goes with it
    assert not os.path.exists(store.data_path(record.data))


def _publish(s: store.KeptStore, step: int, fill: bytes) -> KeptRecord:
    slab = f"mpckpt-test-slab-{secrets.token_hex(8)}"
    fd = os.open(store.data_path(slab), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, fill * 4096)
    os.close(fd)
    record = KeptRecord(uid=os.geteuid(), root=s.url, rank=0, world_size=1, step=step, seq=step, data=s.new_data_name(),
                        data_size=4096, created_unix=1.0,
                        spans={"shard-00000.safetensors": Span(b"{}", 0, 4096, None)}, small={"skeleton.json": b"{}"})
    s.publish(record, slab)
    os.unlink(store.data_path(slab))
    return record


def test_several_steps_are_kept_side_by_side_and_dropped_one_by_one(kept):
    s, three = kept
    four = _publish(s, 4, b"\1")
    found = store.read_kept(s.url, 0, 1)
    assert [f.record.step for f in found] == [3, 4]
    assert bytes(found[1].data[:4]) == b"\1" * 4 and bytes(found[0].data[:4]) == b"\0" * 4
    for f in found:
        f.close()
    s.drop(three)
    assert [f.record.step for f in store.read_kept(s.url, 0, 1)] == [4]
    assert not os.path.exists(store.data_path(three.data)) and os.path.exists(store.data_path(four.data))
    [listed] = [k for k in store.list_kept() if k.base == s.base]
    assert listed.steps == (4,) and listed.step == 4 and listed.root == s.url


def test_what_no_checked_record_lists_is_tidied_at_open(kept):
    s, three = kept
    four = _publish(s, 4, b"\1")
    stray = s.new_data_name()
    open(store.data_path(stray), "wb").close()
    os.chmod(store.data_path(stray), 0o600)
    # step 4's record moved under step 5's name: refused when read, removed by tidy with its data
    os.rename(store.data_path(store.record_name(s.base, 4)), store.data_path(store.record_name(s.base, 5)))
    found = store.read_kept(s.url, 0, 1)
    assert [f.record.step for f in found] == [3]
    s.tidy(found)
    for f in found:
        f.close()
    assert not os.path.exists(store.data_path(stray)) and not os.path.exists(store.data_path(four.data))
    assert store.record_names(s.base) == [store.record_name(s.base, 3)]
    assert os.path.exists(store.data_path(three.data))


def test_a_step_of_any_size_is_found_and_released(kept):
    """Steps counted in tokens or milliseconds run past 12 digits: such a record was never listed,
    so a restart missed it and the close left it behind in /dev/shm."""
    s, three = kept
    big = _publish(s, 2**63 - 1, b"\2")
    found = store.read_kept(s.url, 0, 1)
    assert [f.record.step for f in found] == [3, big.step]
    for f in found:
        f.close()
    s.release(leave=False)
    assert not any(name.startswith(s.base) for name in os.listdir("/dev/shm")), "left behind in /dev/shm"
