"""The uploader process: reads jobs from its pipe, writes files, answers with results.

Runs outside the training process's GIL and, at the default ``uploader_priority`` ('idle'),
below it. Imports no torch: a job names a
shared-memory segment, an offset and a length, and the data goes from that mapping to
storage without passing through a pipe or being copied into the worker (the backend gets
memoryview slices of the mapping).

At start the worker takes on the environment the training process had when its
Checkpointer opened (credentials and settings put into ``os.environ`` later in a notebook
reach it), names itself ``mpckpt-uploader <index> <root>`` for ps/top, and opens the backend.

Messages (tuples, trainer -> worker):
    ("ping", job_id)                       proves the backend can be written (a probe write),
                                           answered with ("ok", job_id, {"pid": ...})
    ("write", job_id, WriteJob)            a shard: header bytes + a slab range
    ("upload", job_id, UploadJob)          a file the user wrote (directory checkpoints)
    ("stop",)                              exit cleanly
Answers (worker -> trainer): ("ok", job_id, result dict) or ("err", job_id, RemoteFailure).

If the trainer dies the worker dies with it (PR_SET_PDEATHSIG), so an orphaned uploader
never keeps writing into a folder that the next run is cleaning up.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Any

from mpckpt._preemption import JOB_SIGNALS
from mpckpt._system.processes import RemoteFailure, prctl, process_alive, set_title
from mpckpt._system.shm import Segment
from mpckpt.format.checksums import file_checksums, file_digest
from mpckpt.storage import BackendSpec, open_backend


@dataclass(frozen=True)
class WriteJob:
    relpath: str
    segment: str
    segment_size: int
    offset: int
    length: int
    header: bytes
    # > 0: also the xxh3-64 of every block of this many bytes of the file (the last one may be
    # shorter), so that a reader of a byte range verifies it without reading the whole file
    block_size: int = 0


@dataclass(frozen=True)
class WorkerSetup:
    """What an uploader needs to start: where it writes, as whom, and how it is named."""

    spec: BackendSpec
    nice: int                                   # added to the nice value the trainer has
    index: int = 0
    trainer_pid: int = 0                        # 0: a thread of the trainer (no process of its own)
    environ: dict[str, str] | None = None       # the trainer's environment when its Checkpointer opened
    sched_idle: bool = True                     # SCHED_IDLE, where Linux has it (``UploaderPriority``)

    @property
    def title(self) -> str:
        return f"mpckpt-uploader {self.index} {self.spec.root}"


@dataclass(frozen=True)
class UploadJob:
    relpath: str
    local_path: str


def _run_below_training(nice: int, *, sched_idle: bool) -> None:
    """Take the uploader priority: ``nice`` above the trainer's nice value, and SCHED_IDLE
    where Linux offers it if ``sched_idle`` (``config.UploaderPriority``).

    SCHED_IDLE runs the uploader only on cycles nothing else wants, so on a busy box the
    uploads take longer (the memory budget then applies back-pressure, and saves wait longer
    to become durable) instead of slowing the training steps. Without it the uploader keeps
    the trainer's policy (SCHED_IDLE itself never: that would make 'low' and 'normal' idle).
    """
    if nice:
        try:
            os.nice(nice)
        except OSError:
            pass
    if not (hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE")):
        return
    try:
        if sched_idle:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        elif os.sched_getscheduler(0) == os.SCHED_IDLE:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    except OSError:
        pass


def _die_with_parent() -> None:
    prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _take_environment(environ: dict[str, str]) -> None:
    """Become the trainer's environment of the moment its Checkpointer opened."""
    os.environ.clear()
    os.environ.update(environ)


class _Worker:
    def __init__(self, spec: BackendSpec) -> None:
        self.backend = open_backend(spec)
        self.segments: dict[str, Segment] = {}

    def segment(self, name: str, size: int) -> Segment:
        seg = self.segments.get(name)
        if seg is None or seg.size != size:
            self.forget_missing_segments()  # a new slab often means old ones were dropped
            seg = Segment.attach(name, size)
            self.segments[name] = seg
        return seg

    def forget_missing_segments(self) -> None:
        """Unmap segments the trainer unlinked, so their memory can really be freed."""
        for name in list(self.segments):
            if not os.path.exists(f"/dev/shm/{name}"):
                self.segments.pop(name).close()

    def write(self, job: WriteJob) -> dict[str, Any]:
        started = time.perf_counter()
        seg = self.segment(job.segment, job.segment_size)
        data = memoryview(seg.mmap)[job.offset:job.offset + job.length]
        try:
            digest, blocks = file_checksums(job.header, data, job.block_size)  # one pass: whole and blocks
            self.backend.write_file(job.relpath, [job.header, data])
        finally:
            data.release()
        result = {"size": len(job.header) + job.length, "checksum": digest, "seconds": time.perf_counter() - started}
        if job.block_size:
            result["blocks"] = list(blocks)
        return result

    def upload(self, job: UploadJob) -> dict[str, Any]:
        started = time.perf_counter()
        size, checksum = file_digest(job.local_path)
        self.backend.upload_file(job.relpath, job.local_path)
        return {"size": size, "checksum": checksum, "seconds": time.perf_counter() - started}


def worker_main(conn: Any, setup: WorkerSetup) -> None:
    """Entry point of an uploader process (or thread, for storage that lives in this process)."""
    trainer_pid = setup.trainer_pid
    if trainer_pid:
        _die_with_parent()
        for sig in JOB_SIGNALS:  # Ctrl-C and a scheduler's warnings are the trainer's to handle:
            signal.signal(sig, signal.SIG_IGN)  # it may still save (preemption=); we die with it anyway
        set_title(setup.title)
        if setup.environ is not None:
            _take_environment(setup.environ)
        _run_below_training(setup.nice, sched_idle=setup.sched_idle)
    try:
        worker: _Worker | None = _Worker(setup.spec)
        startup_error = None
    except BaseException as e:  # reported on the first message, never swallowed
        worker, startup_error = None, RemoteFailure.capture(e)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        kind = msg[0]
        if kind == "stop" or (trainer_pid and not process_alive(trainer_pid)):
            return  # with forkserver our parent is the server, so also watch the trainer itself
        job_id = msg[1]
        if startup_error is not None:
            conn.send(("err", job_id, startup_error))
            continue
        assert worker is not None
        try:
            if kind == "ping":
                worker.backend.check_writable()  # this process, its environment, can write
                result: dict[str, Any] = {"pid": os.getpid()}
            elif kind == "write":
                result = worker.write(msg[2])
            elif kind == "upload":
                result = worker.upload(msg[2])
            else:
                raise ValueError(f"unknown job kind {kind!r}")
            reply: tuple[str, Any, Any] = ("ok", job_id, result)
        except BaseException as e:
            reply = ("err", job_id, RemoteFailure.capture(e))
        try:
            conn.send(reply)
        except (BrokenPipeError, EOFError, ConnectionResetError):
            return  # the trainer is gone (killed): nobody is left to tell
