"""The sequencing ledger on its own, over a real ``LocalBackend`` in ``tmp_path`` (no mocks).

Records are driven the way ``_saving``/``checkpointer`` drive them: ``open``, ``staging =
backend.stage(...)``, jobs counted under ``ledger.lock``, then ``file_done`` / ``file_failed`` /
``all_submitted`` / ``resolve``. Covered: commits strictly in sequence order while later
records settle first (``committed``, ``latest_step`` and the futures only move in order), a
failed or dropped record never blocks later ones, ``wait`` is bounded and names the unfinished
steps, ``scan`` finds committed checkpoints and cleans only crash debris, and sequence numbers
continue after the manifests already on storage. Waits are bounded; no sleep is an assertion.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator

import pytest

from mpckpt._futures import SaveFuture, SaveStats
from mpckpt._ledger import Ledger, Pending
from mpckpt.catalog import scan
from mpckpt.errors import CommitConflictError, CorruptCheckpointError, UploadError, WaitTimeoutError
from mpckpt.format.manifest import FileEntry, Manifest, checkpoint_name, checksum
from mpckpt.storage import MANIFEST_NAME
from mpckpt.storage.local import LocalBackend

BOUND_S = 30.0  # an upper bound for things that must happen; never what a test measures
HELD_S = 0.3    # how long a record that must stay pending is given to (wrongly) finish


@pytest.fixture
def backend(tmp_path) -> LocalBackend:
    return LocalBackend(str(tmp_path / "root"))


@pytest.fixture
def make_ledger(backend) -> Iterator[Callable[..., Ledger]]:
    """Ledgers over ``backend``; at teardown unsettled records are dropped and every ledger closed."""
    ledgers: list[Ledger] = []

    def make(**kwargs: object) -> Ledger:
        ledger = Ledger(backend, scan(backend, clean=False), **kwargs)  # type: ignore[arg-type]
        ledgers.append(ledger)
        return ledger

    yield make
    for ledger in ledgers:
        for record in ledger.pending():
            ledger.resolve(record, "dropped")
        ledger.close(timeout_s=BOUND_S)
        assert not ledger._thread.is_alive(), "the committer thread did not stop"


def open_record(ledger: Ledger, backend: LocalBackend, step: int, *, jobs: int = 1) -> Pending:
    """A save of ``step`` with ``jobs`` file jobs queued, as ``Snapshotter`` submits them."""
    record = ledger.open(step, "state", SaveFuture(SaveStats(step)), {"loss": 1.0 / (step + 1)})
    record.staging = backend.stage(record.name)
    with ledger.lock:
        record.jobs_left += jobs
    ledger.all_submitted(record)
    return record


def write_file(ledger: Ledger, backend: LocalBackend, record: Pending, rel: str = "shard-0.safetensors") -> None:
    """One of ``record``'s jobs writes its file and reports it, like the pool callback."""
    data = f"step {record.step} {rel}".encode()
    backend.write_file(f"{record.staging}/{rel}", [data])
    ledger.file_done(record, rel, FileEntry(len(data), checksum(data)))


def assert_still_pending(ledger: Ledger, records: list[Pending]) -> None:
    with pytest.raises(WaitTimeoutError):
        ledger.wait(records, timeout_s=HELD_S)
    assert not any(r.future.done() for r in records)


def test_commits_strictly_in_order_when_later_saves_settle_first(backend, make_ledger):
    futures: list[SaveFuture] = []
    seen: list[tuple[int, int | None, list[int], list[bool]]] = []
    inside_first, let_go = threading.Event(), threading.Event()

    def on_committed(record: Pending, manifest: Manifest) -> None:
        # what the world looks like at each commit (asserted on the test thread below)
        seen.append((record.step, ledger.latest_step(), sorted(ledger.committed), [f.done() for f in futures]))
        if record.step == 10:
            inside_first.set()
            let_go.wait(BOUND_S)  # hold the committer right after committing step 10

    ledger = make_ledger(on_committed=on_committed)
    r10, r20, r30 = (open_record(ledger, backend, step) for step in (10, 20, 30))
    futures += [r10.future, r20.future, r30.future]
    write_file(ledger, backend, r30)
    write_file(ledger, backend, r20)
    assert r30.settled and r20.settled and not r10.settled
    assert_still_pending(ledger, [r20, r30])  # settled, but behind step 10
    assert ledger.latest_step() is None and ledger.committed == {}

    write_file(ledger, backend, r10)
    assert inside_first.wait(BOUND_S)
    # step 10 is committed; 20 and 30 are settled but must not have moved past it
    assert ledger.latest_step() == 10 and sorted(ledger.committed) == [10]
    assert not r20.future.done() and not r30.future.done()
    let_go.set()
    ledger.wait(timeout_s=BOUND_S)

    assert seen == [(10, 10, [10], [False, False, False]),
                    (20, 20, [10, 20], [True, False, False]),
                    (30, 30, [10, 20, 30], [True, True, False])]
    assert [f.result(0).name for f in futures] == [checkpoint_name(s) for s in (10, 20, 30)]
    assert [f.stats.status for f in futures] == ["committed"] * 3
    on_disk = scan(backend, clean=False)
    assert [(m.step, m.seq) for m in on_disk.values()] == [(10, 0), (20, 1), (30, 2)]
    assert set(on_disk[20].files) == {"shard-0.safetensors"}


def test_failed_save_waits_for_its_running_jobs_then_lets_later_ones_commit(backend, make_ledger):
    ledger = make_ledger()
    r1 = open_record(ledger, backend, 1, jobs=2)
    r2 = open_record(ledger, backend, 2)
    write_file(ledger, backend, r2)
    cause = OSError(5, "disk on fire")
    ledger.resolve(r1, "failed", cause)  # one file of step 1 failed, as the pool reports it
    ledger.file_failed(r1)
    # its other job still runs: aborting the staging folder now would race with it
    assert_still_pending(ledger, [r1, r2])

    write_file(ledger, backend, r1, "shard-1.safetensors")
    ledger.wait(timeout_s=BOUND_S)
    error = r1.future.exception(0)
    assert isinstance(error, UploadError) and error.step == 1 and "step 1" in str(error)
    assert error.__cause__ is cause
    assert r1.future.stats.status == "failed"
    assert r2.future.result(0).name == checkpoint_name(2)
    assert list(scan(backend, clean=False)) == [2]
    assert sorted(os.listdir(backend.root)) == [checkpoint_name(2)]  # step 1's staging was aborted


def test_upload_error_is_passed_on_and_a_failed_commit_fails_only_its_save(backend, make_ledger):
    ledger = make_ledger()
    r1, r2, r3 = (open_record(ledger, backend, step) for step in (1, 2, 3))
    shard_error = UploadError("step 1: writing shard-0.safetensors failed", step=1, shard="shard-0.safetensors")
    ledger.resolve(r1, "failed", shard_error)
    ledger.file_failed(r1)
    # someone else commits step 2 first: our commit of it must fail, not overwrite it
    theirs = backend.stage(checkpoint_name(2))
    backend.commit(theirs, checkpoint_name(2), Manifest(step=2, seq=99, kind="state", files={}).to_bytes())
    write_file(ledger, backend, r2)
    write_file(ledger, backend, r3)
    ledger.wait(timeout_s=BOUND_S)

    assert r1.future.exception(0) is shard_error
    error = r2.future.exception(0)
    assert isinstance(error, UploadError) and error.step == 2 and "step 2" in str(error)
    assert isinstance(error.__cause__, CommitConflictError)
    assert r3.future.result(0).name == checkpoint_name(3)
    assert sorted(ledger.committed) == [3]
    assert scan(backend, clean=False)[2].seq == 99  # theirs, untouched


def test_dropped_save_resolves_with_none_and_does_not_block(backend, make_ledger):
    ledger = make_ledger()
    r1 = open_record(ledger, backend, 1)  # its job never ran: coalesced away
    r2 = open_record(ledger, backend, 2)
    write_file(ledger, backend, r2)
    r1.future.stats.status = "coalesced"  # the caller sets it, the ledger keeps it
    ledger.resolve(r1, "dropped")
    backend.abort(r1.staging)
    ledger.wait(timeout_s=BOUND_S)
    assert r1.future.result(0).name is None and r1.future.stats.status == "coalesced"
    assert r2.future.result(0).name == checkpoint_name(2)
    assert list(scan(backend, clean=False)) == [2]


def test_wait_is_bounded_and_names_the_unfinished_steps(backend, make_ledger):
    ledger = make_ledger()
    r7, r8, r9 = (open_record(ledger, backend, step) for step in (7, 8, 9))
    write_file(ledger, backend, r9)  # settled, but still behind 7 and 8
    with pytest.raises(WaitTimeoutError, match=r"steps 7, 8, 9 not finished"):
        ledger.wait(timeout_s=HELD_S)
    with pytest.raises(WaitTimeoutError, match=r"steps 8 not finished"):
        ledger.wait([r8], timeout_s=HELD_S)
    write_file(ledger, backend, r7)
    ledger.wait([r7], timeout_s=BOUND_S)  # only what was asked for
    with pytest.raises(WaitTimeoutError, match=r"steps 8, 9 not finished"):
        ledger.wait(timeout_s=HELD_S)
    ledger.resolve(r8, "dropped")
    ledger.wait(timeout_s=BOUND_S)
    assert sorted(ledger.committed) == [7, 9] and ledger.pending() == []


def _commit_directly(backend: LocalBackend, step: int, seq: int, files: dict[str, FileEntry] | None = None) -> None:
    staging = backend.stage(checkpoint_name(step))
    backend.commit(staging, checkpoint_name(step), Manifest(step=step, seq=seq, kind="state", files=files or {})
                   .to_bytes())


def _folder(backend: LocalBackend, name: str, files: dict[str, bytes]) -> str:
    path = os.path.join(backend.root, name)
    os.makedirs(path)
    for rel, data in files.items():
        with open(os.path.join(path, rel), "wb") as f:
            f.write(data)
    return path


def test_scan_finds_committed_checkpoints_and_cleans_only_debris(backend):
    _commit_directly(backend, 1, 0)
    _commit_directly(backend, 2, 1)
    debris = _folder(backend, checkpoint_name(3), {"shard-0.safetensors": b"half"})  # a crash mid-save
    used = _folder(backend, checkpoint_name(4), {"frozen.safetensors": b"frozen"})  # no manifest, but used
    _commit_directly(backend, 5, 2, {"frozen.safetensors": FileEntry(6, checksum(b"frozen"), ref=checkpoint_name(4))})
    damaged = _folder(backend, checkpoint_name(6), {MANIFEST_NAME: b'{"format": "mpck'})
    stranger = _folder(backend, "notes", {"readme.txt": b"mine"})

    problems: dict[int, Exception] = {}
    assert sorted(scan(backend, clean=False, problems=problems)) == [1, 2, 5]
    assert list(problems) == [6] and isinstance(problems[6], CorruptCheckpointError)
    assert all(os.path.isdir(p) for p in (debris, used, damaged, stranger))

    found = scan(backend, clean=True)
    assert sorted(found) == [1, 2, 5] and found[5].files["frozen.safetensors"].ref == checkpoint_name(4)
    assert not os.path.exists(debris)
    assert all(os.path.isdir(p) for p in (used, damaged, stranger))  # never deleted
    assert scan(backend, clean=True).keys() == found.keys()  # a second scan changes nothing


def test_sequence_numbers_continue_after_the_manifests_on_storage(backend, make_ledger):
    _commit_directly(backend, 1, 4)  # seqs need not be dense, nor follow the steps
    _commit_directly(backend, 2, 9)
    _commit_directly(backend, 3, 6)
    ledger = make_ledger(taken_steps={50})
    assert ledger.latest_step() == 3 and ledger.last_step == 50
    r60, r70 = open_record(ledger, backend, 60), open_record(ledger, backend, 70)
    assert (r60.seq, r70.seq) == (10, 11)
    write_file(ledger, backend, r70)
    write_file(ledger, backend, r60)
    ledger.wait(timeout_s=BOUND_S)  # the first commit is seq 10: no wait for seqs that never come
    assert [f.result(0).name for f in (r60.future, r70.future)] == [checkpoint_name(60), checkpoint_name(70)]
    assert ledger.latest_step() == 70 and ledger.last_step == 70
    assert {s: m.seq for s, m in scan(backend, clean=False).items()} == {1: 4, 2: 9, 3: 6, 60: 10, 70: 11}


def test_a_hook_that_fails_after_a_commit_never_stops_later_commits(backend, make_ledger):
    ledger = make_ledger()
    first = open_record(ledger, backend, 1)
    first.after_commit.append(lambda: {}["a bug in a hook"])
    write_file(ledger, backend, first)
    second = open_record(ledger, backend, 2)
    write_file(ledger, backend, second)
    ledger.wait([first, second], timeout_s=BOUND_S)
    assert first.future.result(0).name == "step_0000000001"  # the commit stands
    assert second.future.result(0).name == "step_0000000002"
    assert sorted(ledger.committed) == [1, 2]
