"""The uploader pool with real worker processes (``forkserver``, as the Checkpointer starts them).

Covered: ``start`` pings every worker (they prove they can write to the root, or start fails
and leaves no process behind); ``start(wait=False)`` returns at once, jobs queued meanwhile are
written once the workers answer, a start held back (``hold_s``) spawns nothing until ``go``, a
submit or its bound, and a failed start comes out of ``ready`` (once for a wait,
every time for a caller that needs the workers) and fails the queued jobs; write jobs from a real shared-memory segment produce files of
header + slab bytes and report their size and xxh3 checksum; jobs are spread over the
workers; a worker SIGKILLed in the middle of a job is replaced and the job retried; a job
that keeps killing its worker (its own SIGKILL, or its deadline) fails with an
``UploadError`` naming the file; a failing write comes back with its type and remote
traceback; ``cancel`` drops queued jobs only while every worker is busy; ``close`` stops
every worker process. Slow or deadly storage is ``tests/backends.py``'s ``ctl://`` backend.
Every wait is bounded; no duration is asserted.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
import xxhash

from mpckpt._system.shm import Segment
from mpckpt._upload.pool import Job, UploaderPool
from mpckpt._upload.worker import WriteJob
from mpckpt.errors import ConfigError, UploadError
from mpckpt.storage import BackendSpec, spec_for_url
from tests.backends import ctl_url
from tests.waiting import wait_until

SIZE = 1 << 20
BOUND_S = 60.0  # an upper bound for things that must happen; never what a test measures
SLOW_S = 3.0    # a write the test acts on while it runs (kill, cancel)


@pytest.fixture
def segment() -> Iterator[Segment]:
    seg = Segment.create(SIZE)
    try:
        seg.mmap[:] = random.Random(7).randbytes(SIZE)
        yield seg
    finally:
        seg.close()
        seg.unlink()


@contextlib.contextmanager
def started(spec: BackendSpec, *, workers: int, **options: Any) -> Iterator[UploaderPool]:
    pool = UploaderPool(spec, workers=workers, start_method="forkserver", **options)
    pool.start()  # on failure it stops what it started
    try:
        yield pool
    finally:
        pool.close(timeout_s=BOUND_S)


def ctl_spec(tmp_path, **rules: Any) -> BackendSpec:
    markers = tmp_path / "markers"
    markers.mkdir(exist_ok=True)
    return spec_for_url(ctl_url(tmp_path / "root"), {"marker_dir": str(markers), **rules})


class Results:
    """Collects the pool's callbacks; ``wait_for`` blocks (bounded) until some relpaths are done."""

    def __init__(self) -> None:
        self.done: dict[str, tuple[Job, dict[str, Any] | None, BaseException | None]] = {}
        self.order: list[str] = []
        self._cond = threading.Condition()

    def __call__(self, job: Job, result: dict[str, Any] | None, error: BaseException | None) -> None:
        with self._cond:
            self.done[job.payload.relpath] = (job, result, error)
            self.order.append(job.payload.relpath)
            self._cond.notify_all()

    def wait_for(self, *relpaths: str) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: set(relpaths) <= set(self.done), BOUND_S), (relpaths, self.order)


def write_job(seg: Segment, relpath: str, results: Results, *, offset: int = 0, length: int = 4096,
              tag: Any = None, timeout_s: float | None = None) -> Job:
    header = f'{{"file": "{relpath}"}}'.encode()
    return Job("write", WriteJob(relpath, seg.name, seg.size, offset, length, header), results, tag=tag, step=3,
               timeout_s=timeout_s)


def expected_bytes(seg: Segment, job: Job) -> bytes:
    p = job.payload
    assert isinstance(p, WriteJob)
    return p.header + bytes(seg.mmap[p.offset:p.offset + p.length])


def maps(pid: int, seg: Segment) -> bool:
    """Whether worker ``pid`` has mapped ``seg`` (it does so when it starts a write from it)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return seg.name in f.read()
    except OSError:
        return False


def assert_gone(pids: list[int]) -> None:
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            procs.append(psutil.Process(pid))
    _gone, alive = psutil.wait_procs(procs, timeout=BOUND_S)
    assert not alive, alive


def test_start_pings_every_worker_and_close_stops_them(tmp_path, segment):
    root = tmp_path / "root"
    results = Results()
    with started(spec_for_url(str(root)), workers=3) as pool:
        assert root.is_dir()  # each worker's ping probed the root before start() returned
        pids = pool.pids
        assert len(set(pids)) == 3 and os.getpid() not in pids
        assert all(psutil.Process(pid).name() == "mpckpt-uploader" for pid in pids)
        pool.submit(write_job(segment, "a.bin", results))
        results.wait_for("a.bin")
        assert not pool.busy()
    assert pool.pids == [] and not pool._thread.is_alive()
    assert_gone(pids)


def test_start_fails_when_the_uploaders_cannot_write_and_leaves_no_process(tmp_path):
    pool = UploaderPool(ctl_spec(tmp_path, writable_only_in_pid=os.getpid()), workers=2, start_method="forkserver")
    pids: list[int] = []
    spawn = pool._spawn

    def spawn_and_note(index: int) -> Any:  # the pids of the workers that start() starts
        slot = spawn(index)
        pids.append(slot.process.pid)
        return slot

    pool._spawn = spawn_and_note  # type: ignore[method-assign]
    with pytest.raises(ConfigError, match="uploader processes cannot write there"):
        pool.start()
    assert len(pids) == 2
    assert_gone(pids)


def test_a_start_in_the_background_queues_jobs_until_the_workers_answer(tmp_path, segment):
    results = Results()
    pool = UploaderPool(spec_for_url(str(tmp_path / "root")), workers=2, start_method="forkserver")
    try:
        pool.start(wait=False)
        pool.submit(write_job(segment, "early.bin", results))  # before any worker has answered its ping
        results.wait_for("early.bin")
        pool.ready()
        assert len(pool.pids) == 2
    finally:
        pool.close(timeout_s=BOUND_S)
    _, result, error = results.done["early.bin"]
    assert error is None and result is not None
    assert (tmp_path / "root" / "early.bin").read_bytes() == expected_bytes(segment, results.done["early.bin"][0])


def test_a_held_start_waits_for_go_a_submit_or_its_bound_and_nothing_else(tmp_path, segment):
    """``start(wait=False, hold_s=)``: no worker while a restore reads; ``go``, a submit or the
    bound each start them (``ready`` does too: it is what a save calls first)."""
    spec = spec_for_url(str(tmp_path / "root"))
    results = Results()
    pools = [UploaderPool(spec, workers=1, start_method="forkserver") for _ in range(3)]
    try:
        for pool in pools[:2]:
            pool.start(wait=False, hold_s=BOUND_S * 10)
        pools[2].start(wait=False, hold_s=0.3)
        # the third pool's bound has passed (its workers are up); the others' has not
        wait_until(pools[2]._started.is_set, BOUND_S, "the third pool's start at the end of its 0.3 s hold")
        assert not pools[0]._slots and not pools[1]._slots, "a held start spawned its workers"
        assert not pools[0]._started.is_set() and not pools[1]._started.is_set()
        pools[0].go()
        pools[1].submit(write_job(segment, "held.bin", results))
        results.wait_for("held.bin")
        for pool in pools:
            pool.ready()
            assert len(pool.pids) == 1
    finally:
        for pool in pools:
            pool.close(timeout_s=BOUND_S)
    _, result, error = results.done["held.bin"]
    assert error is None and result is not None
    assert not any(pool._thread.is_alive() for pool in pools)


def test_a_failed_start_in_the_background_comes_out_of_ready_and_fails_the_queued_jobs(tmp_path, segment):
    results = Results()
    pool = UploaderPool(ctl_spec(tmp_path, writable_only_in_pid=os.getpid()), workers=2, start_method="forkserver")
    try:
        pool.start(wait=False)
        pool.submit(write_job(segment, "queued.bin", results))
        with pytest.raises(ConfigError, match="uploader processes cannot write there"):
            pool.ready()
        with pytest.raises(ConfigError, match="uploader processes cannot write there"):
            pool.ready()  # a caller that needs the workers hears it every time
        pool.ready(again=False)  # a wait or a close only if nobody has seen it
        results.wait_for("queued.bin")
        pool.submit(write_job(segment, "later.bin", results))
        results.wait_for("later.bin")
        assert pool.pids == []
    finally:
        pool.close(timeout_s=BOUND_S)
    for relpath in ("queued.bin", "later.bin"):
        _, result, error = results.done[relpath]
        assert result is None and isinstance(error, UploadError) and error.shard == relpath
        assert "did not start" in str(error) and isinstance(error.__cause__, ConfigError)
    assert not pool._thread.is_alive()


def test_write_jobs_write_header_and_slab_bytes_spread_over_the_workers(tmp_path, segment):
    results = Results()
    spans = [(0, 4096), (4096, 100), (8192, SIZE - 8192), (12345, 1), (0, 0), (SIZE - 3, 3)]
    jobs = [write_job(segment, f"stage/shard-{i}.safetensors", results, offset=o, length=n)
            for i, (o, n) in enumerate(spans)]
    with started(spec_for_url(str(tmp_path / "root")), workers=2) as pool:
        pool.submit(*jobs)
        results.wait_for(*(j.payload.relpath for j in jobs))
        assert all(maps(pid, segment) for pid in pool.pids)  # both workers wrote from it
    for job in jobs:
        _, result, error = results.done[job.payload.relpath]
        assert error is None and result is not None
        data = expected_bytes(segment, job)
        assert (tmp_path / "root" / job.payload.relpath).read_bytes() == data
        assert result["size"] == len(data)
        assert result["checksum"] == xxhash.xxh3_64(data).hexdigest()
        assert job.attempts == 1


def test_a_killed_worker_is_replaced_and_its_job_retried(tmp_path, segment):
    results = Results()
    job = write_job(segment, "slow.bin", results)
    with started(ctl_spec(tmp_path, delay={"slow": SLOW_S}), workers=1) as pool:
        victim = pool.pids[0]
        pool.submit(job)
        wait_until(lambda: maps(victim, segment), BOUND_S, "the worker inside the job (the segment mapped)")
        os.kill(victim, signal.SIGKILL)
        results.wait_for("slow.bin")
        assert pool.restarts == 1 and pool.retries == 1
        assert pool.pids != [victim] and maps(pool.pids[0], segment)
    _, result, error = results.done["slow.bin"]
    assert error is None and result is not None and job.attempts == 2
    assert (tmp_path / "root" / "slow.bin").read_bytes() == expected_bytes(segment, job)
    assert_gone([victim])


def test_a_job_that_kills_its_worker_every_time_fails_naming_the_file(tmp_path, segment):
    results = Results()
    with started(ctl_spec(tmp_path, kill_worker=["deadly"]), workers=1, max_attempts=1) as pool:
        pool.submit(write_job(segment, "stage/deadly.bin", results), write_job(segment, "fine.bin", results))
        results.wait_for("stage/deadly.bin", "fine.bin")
        assert pool.restarts == 1 and pool.retries == 0
    _, _, error = results.done["stage/deadly.bin"]
    assert isinstance(error, UploadError) and error.shard == "stage/deadly.bin" and error.step == 3
    assert "stage/deadly.bin" in str(error) and "died" in str(error) and "tried 1 time" in str(error)
    assert results.done["fine.bin"][2] is None  # the replacement took the next job


def test_a_job_past_its_deadline_is_killed_and_fails_after_max_attempts(tmp_path, segment):
    results = Results()
    with started(ctl_spec(tmp_path, delay={"hangs": 3600}), workers=1, max_attempts=2) as pool:
        pool.submit(write_job(segment, "hangs.bin", results, timeout_s=0.5))
        results.wait_for("hangs.bin")
        assert pool.restarts == 2 and pool.retries == 1
        pool.submit(write_job(segment, "after.bin", results))
        results.wait_for("after.bin")
    job, _, error = results.done["hangs.bin"]
    assert isinstance(error, UploadError) and error.shard == "hangs.bin"
    assert "hangs.bin" in str(error) and "deadline" in str(error) and "tried 2 time" in str(error)
    assert job.attempts == 2 and not (tmp_path / "root" / "hangs.bin").exists()
    assert results.done["after.bin"][2] is None


def test_a_failed_write_comes_back_with_its_type_and_remote_traceback(tmp_path, segment):
    results = Results()
    with started(ctl_spec(tmp_path, fail={"bad": "injected failure"}), workers=1) as pool:
        pool.submit(write_job(segment, "bad.bin", results))
        results.wait_for("bad.bin")
        assert pool.restarts == 0 and pool.retries == 0  # an error is an answer, not a death
    _, result, error = results.done["bad.bin"]
    assert result is None and isinstance(error, OSError) and error.errno == 5
    assert "injected failure" in str(error)
    assert any("raised in an mpckpt uploader process" in note for note in getattr(error, "__notes__", []))


def test_cancel_drops_queued_jobs_only_while_every_worker_is_busy(tmp_path, segment):
    results = Results()
    with started(ctl_spec(tmp_path, delay={"slow": SLOW_S}), workers=1) as pool:
        assert not pool.cancel("b")  # an idle worker: nothing waits in a queue
        pool.submit(write_job(segment, "slow.bin", results, tag="a"))
        wait_until(lambda: pool.started("a"), BOUND_S, "job a started")
        pool.submit(write_job(segment, "b1.bin", results, tag="b"), write_job(segment, "b2.bin", results, tag="b"))
        assert not pool.cancel("a")  # already running
        assert pool.cancel("b")
        pool.submit(write_job(segment, "c.bin", results, tag="c"))
        results.wait_for("slow.bin", "c.bin")  # c was queued behind b: b can no longer run
    assert results.order == ["slow.bin", "c.bin"]
    assert not (tmp_path / "root" / "b1.bin").exists() and not (tmp_path / "root" / "b2.bin").exists()


def test_close_is_idempotent_and_never_touches_descriptors_it_gave_up(tmp_path):
    pool = UploaderPool(spec_for_url(str(tmp_path / "root")), workers=1, start_method="forkserver")
    pool.start()
    pool.close(timeout_s=BOUND_S)
    r, w = os.pipe()  # likely reuses the numbers of the pool's wake-up pipe
    try:
        pool.close(timeout_s=BOUND_S)
        os.write(w, b"ok")
        assert os.read(r, 2) == b"ok"  # still ours, still open, nothing written into it
    finally:
        os.close(r)
        os.close(w)


def test_a_close_that_times_out_fails_the_jobs_left_and_stops_the_dispatcher(tmp_path, segment):
    results = Results()
    pool = UploaderPool(ctl_spec(tmp_path, delay={r"slow": SLOW_S}), workers=1, start_method="forkserver")
    pool.start()
    pids = pool.pids
    pool.submit(write_job(segment, "slow-1.bin", results), write_job(segment, "slow-2.bin", results))
    wait_until(lambda: pool.started(None), BOUND_S, "the job started")
    pool.close(timeout_s=0.5)  # shorter than the queue: what is left must fail, not hang
    results.wait_for("slow-1.bin", "slow-2.bin")
    assert any(isinstance(results.done[rel][2], UploadError) for rel in ("slow-1.bin", "slow-2.bin"))
    assert "closed before" in str(results.done["slow-2.bin"][2])
    assert not pool._thread.is_alive()
    assert_gone(pids)
