"""The sequencing ledger and the committer on their own, over a real ``LocalBackend`` in ``tmp_path``.

No uploader pool and no snapshot: records are driven the way ``_saving`` and ``_directory``
drive them: ``recording``, ``add_jobs``, ``all_submitted``, and the pool callback
``job_done`` called as the pool calls it, with a file really written. Covered: commits strictly in sequence order while later
records settle first (``committed``, ``latest_step`` and the futures only move in order), a
failed or dropped record never blocks later ones, ``wait`` is bounded and names the unfinished
steps, ``scan`` finds committed checkpoints and cleans only crash debris, and sequence numbers
continue after the manifests already on storage, retention deletes through the ``Deleter``
and never a folder a pending save references. Waits are bounded; no sleep is an assertion.
"""

from __future__ import annotations

import os
import threading
import types
from collections.abc import Callable, Iterator

import pytest

from mpckpt._commit.committer import Committer
from mpckpt._commit.coordinator import SingleProcess
from mpckpt._commit.deleter import Deleter
from mpckpt._futures import SaveFuture, SaveStats
from mpckpt._ledger import Ledger, Pending
from mpckpt.catalog import scan
from mpckpt.errors import CommitConflictError, CorruptCheckpointError, UploadError, WaitTimeoutError
from mpckpt.format.manifest import FileEntry, Manifest, checkpoint_name, checksum
from mpckpt.policies.retention import KeepLast, RetentionPolicy
from mpckpt.storage import MANIFEST_NAME
from mpckpt.storage.local import LocalBackend
from tests.waiting import wait_until

BOUND_S = 30.0  # an upper bound for things that must happen; never what a test measures
HELD_S = 0.3    # how long a record that must stay pending is given to (wrongly) finish


@pytest.fixture
def backend(tmp_path) -> LocalBackend:
    return LocalBackend(str(tmp_path / "root"))


@pytest.fixture
def make_ledger(backend) -> Iterator[Callable[..., Ledger]]:
    """Ledgers over ``backend``, each with its committer; at teardown unsettled records are
    dropped and every committer stopped."""
    running: list[tuple[Ledger, Committer, Deleter]] = []

    def make(*, taken_steps: set[int] | None = None, retention: RetentionPolicy | None = None) -> Ledger:
        ledger = Ledger(scan(backend, clean=False), staging_name=backend.staging_name, taken_steps=taken_steps)
        deleter = Deleter(backend)
        running.append((ledger, Committer(ledger, backend, SingleProcess(backend), deleter, retention=retention),
                        deleter))
        return ledger

    yield make
    for ledger, committer, deleter in running:
        for record in ledger.pending():
            ledger.resolve(record, "dropped")
        committer.close(timeout_s=BOUND_S)
        deleter.close(timeout_s=BOUND_S)
        assert not committer._thread.is_alive(), "the committer thread did not stop"
        assert not deleter._thread.is_alive(), "the deleter thread did not stop"


def open_record(ledger: Ledger, backend: LocalBackend, step: int, *, jobs: int = 1) -> Pending:
    """A save of ``step`` with ``jobs`` file jobs queued, as ``Snapshotter`` submits them."""
    with ledger.recording(step, "state", SaveStats(step), {"loss": 1.0 / (step + 1)}) as record:
        ledger.add_jobs(record, jobs)
        ledger.all_submitted(record)
    return record


def _job(record: Pending, rel: str) -> types.SimpleNamespace:
    """What the pool hands its callback: the job, whose payload names the file."""
    return types.SimpleNamespace(payload=types.SimpleNamespace(relpath=f"{record.staging}/{rel}"))


def write_file(ledger: Ledger, backend: LocalBackend, record: Pending, rel: str = "shard-0.safetensors") -> None:
    """One of ``record``'s jobs writes its file and reports it, like the pool callback."""
    data = f"step {record.step} {rel}".encode()
    backend.prepare_staging(record.staging)  # what the pool's dispatcher does before the first job
    backend.write_file(f"{record.staging}/{rel}", [data])
    ledger.job_done(record, "writing shard")(_job(record, rel), {"size": len(data), "checksum": checksum(data)}, None)


def fail_file(ledger: Ledger, record: Pending, cause: BaseException, rel: str = "shard-0.safetensors") -> None:
    """One of ``record``'s jobs fails, as the pool reports it."""
    ledger.job_done(record, "writing shard")(_job(record, rel), None, cause)


def assert_still_pending(ledger: Ledger, records: list[Pending]) -> None:
    with pytest.raises(WaitTimeoutError):
        ledger.wait(records, timeout_s=HELD_S)
    assert not any(r.future.done() for r in records)


def test_commits_strictly_in_order_when_later_saves_settle_first(backend, make_ledger):
    futures: list[SaveFuture] = []
    seen: list[tuple[int, int | None, list[int], list[bool]]] = []
    inside_first, let_go = threading.Event(), threading.Event()

    def on_committed(step: int) -> None:
        # what the world looks like at each commit (asserted on the test thread below)
        seen.append((step, ledger.latest_step(), sorted(ledger.committed()), [f.done() for f in futures]))
        if step == 10:
            inside_first.set()
            let_go.wait(BOUND_S)  # hold the committer right after committing step 10

    ledger = make_ledger()
    r10, r20, r30 = (open_record(ledger, backend, step) for step in (10, 20, 30))
    for record in (r10, r20, r30):
        ledger.after_commit(record, lambda step=record.step: on_committed(step))
    futures += [r10.future, r20.future, r30.future]
    write_file(ledger, backend, r30)
    write_file(ledger, backend, r20)
    assert r30.settled and r20.settled and not r10.settled
    assert_still_pending(ledger, [r20, r30])  # settled, but behind step 10
    assert ledger.latest_step() is None and ledger.committed() == {}

    write_file(ledger, backend, r10)
    assert inside_first.wait(BOUND_S)
    # step 10 is committed; 20 and 30 are settled but must not have moved past it
    assert ledger.latest_step() == 10 and sorted(ledger.committed()) == [10]
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
    fail_file(ledger, r1, cause)  # one file of step 1 failed, as the pool reports it
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
    ledger.resolve(r1, "failed", shard_error)  # the first error of a record is the one it fails with
    fail_file(ledger, r1, OSError(5, "a later one"))
    # someone else commits step 2 first: our commit of it must fail, not overwrite it
    theirs = backend.staging_name(checkpoint_name(2))
    backend.commit(theirs, checkpoint_name(2), Manifest(step=2, seq=99, kind="state", files={}).to_bytes())
    write_file(ledger, backend, r2)
    write_file(ledger, backend, r3)
    ledger.wait(timeout_s=BOUND_S)

    assert r1.future.exception(0) is shard_error
    error = r2.future.exception(0)
    assert isinstance(error, UploadError) and error.step == 2 and "step 2" in str(error)
    assert isinstance(error.__cause__, CommitConflictError)
    assert r3.future.result(0).name == checkpoint_name(3)
    assert sorted(ledger.committed()) == [3]
    assert scan(backend, clean=False)[2].seq == 99  # theirs, untouched


def test_dropped_save_resolves_with_none_and_does_not_block(backend, make_ledger):
    ledger = make_ledger()
    r1 = open_record(ledger, backend, 1)  # its job never ran: coalesced away
    r2 = open_record(ledger, backend, 2)
    write_file(ledger, backend, r2)
    assert ledger.drop(r1, "coalesced") == []  # it held no slab

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
    assert sorted(ledger.committed()) == [7, 9] and ledger.pending() == []


def _commit_directly(backend: LocalBackend, step: int, seq: int, files: dict[str, FileEntry] | None = None) -> None:
    staging = backend.staging_name(checkpoint_name(step))
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
    ledger.after_commit(first, lambda: {}["a bug in a hook"])
    write_file(ledger, backend, first)
    second = open_record(ledger, backend, 2)
    write_file(ledger, backend, second)
    ledger.wait([first, second], timeout_s=BOUND_S)
    assert first.future.result(0).name == "step_0000000001"  # the commit stands
    assert second.future.result(0).name == "step_0000000002"
    assert sorted(ledger.committed()) == [1, 2]


def test_retention_deletes_in_the_background_but_never_what_a_pending_save_references(backend, make_ledger):
    ledger = make_ledger(retention=KeepLast(1))
    first = open_record(ledger, backend, 1)
    write_file(ledger, backend, first, "frozen.safetensors")
    ledger.wait([first], timeout_s=BOUND_S)
    second = open_record(ledger, backend, 2)
    third = open_record(ledger, backend, 3)  # still pending, references step 1's file
    ledger.add_files(third, {"frozen.safetensors": FileEntry(1, "x", ref=checkpoint_name(1))})
    write_file(ledger, backend, second)
    ledger.wait([second], timeout_s=BOUND_S)
    # KeepLast(1) lets step 1 go once step 2 commits, but the pending step 3 needs its file
    assert sorted(ledger.committed()) == [1, 2]
    write_file(ledger, backend, third)
    ledger.wait(timeout_s=BOUND_S)
    assert [r.future.result(0).name for r in (first, second, third)] == [checkpoint_name(s) for s in (1, 2, 3)]
    assert sorted(ledger.committed()) == [1, 3]  # 2 is forgotten at once; 1 stays while 3 references it
    wait_until(lambda: checkpoint_name(2) not in os.listdir(backend.root), BOUND_S,
               "the deleter removing step 2's folder (in the background)", poll_s=0.05)
    assert sorted(os.listdir(backend.root)) == [checkpoint_name(1), checkpoint_name(3)]
