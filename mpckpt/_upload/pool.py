"""The uploader pool: persistent worker processes, jobs in, results and exceptions out.

For storage that exists only inside this process (fsspec ``memory://``) the workers are
threads speaking the same protocol; everything else is the same.

One dispatcher thread owns every pipe: it hands one job at a time to each idle worker and
waits on all pipes *and* all process sentinels at once, so a worker that dies (killed, out
of memory, segfault) is noticed the moment it happens, not after a timeout. The dead worker
is replaced and its job retried on the replacement, up to ``max_attempts`` times; after that
the job fails with an ``UploadError`` naming the file and the exit code.

Workers are started (``spawn``: without the user's main module, with the trainer's
environment) and pinged when the pool starts: each proves it can write to the root, so the
first save finds them warm and storage the *uploaders* cannot write to fails clearly before
any upload. ``start(wait=False)`` leaves that to the dispatcher thread, which does it before
anything else (jobs submitted meanwhile wait in the queue; if the start fails they fail with
its error): the Checkpointer opens while the workers start, a save's jobs queue up meanwhile
(``going``: a failure already known is raised, nothing waits), and ``ready`` (bounded by the
start timeout) gives the outcome to a call that needs the workers up. The start can be
held back a while (``hold_s``): the Runtime lets a restore read first, and ``go`` (the end of a
restore), ``ready`` or a submit start them at once.
They run below training or beside it, as ``priority`` says (``config.UploaderPriority``:
idle by default).

Callbacks (``Job.on_done``) run on the dispatcher thread; they must be short and must not
raise (an exception there is recorded and surfaced by ``take_internal_error``).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from multiprocess.connection import wait as mp_wait

from mpckpt._system.processes import RemoteFailure
from mpckpt._system.spawn import PROCESS_NAME, uploader_context
from mpckpt._threads import Thread
from mpckpt._upload.threadworker import ThreadWorker
from mpckpt._upload.worker import UploadJob, WorkerSetup, WriteJob, worker_main
from mpckpt.config import DEFAULT_MAX_JOB_ATTEMPTS, DEFAULT_START_METHOD, DEFAULT_UPLOADER_PRIORITY, UploaderPriority
from mpckpt.errors import ConfigError, WaitTimeoutError, upload_error
from mpckpt.storage import BackendSpec

log = logging.getLogger("mpckpt")

DoneCallback = Callable[["Job", "dict[str, Any] | None", "BaseException | None"], None]


@dataclass
class Job:
    kind: str                       # "write" or "upload"
    payload: WriteJob | UploadJob
    on_done: DoneCallback
    tag: Any = None                 # the checkpoint it belongs to (for cancel)
    step: int | None = None
    timeout_s: float | None = None  # a worker still on it after this long is killed, the job retried
    attempts: int = 0
    id: int = field(default=0)


class _Slot:
    def __init__(self, process: Any, conn: Any) -> None:
        self.process = process
        self.conn = conn
        self.job: Job | None = None
        self.started = 0.0
        self.overdue = False


class UploaderPool:
    def __init__(
        self, spec: BackendSpec, *, workers: int, start_method: str = DEFAULT_START_METHOD,
        priority: UploaderPriority = DEFAULT_UPLOADER_PRIORITY, max_attempts: int = DEFAULT_MAX_JOB_ATTEMPTS,
        in_process: bool = False, environ: dict[str, str] | None = None,
    ) -> None:
        self.spec = spec
        self.environ = environ
        self.in_process = in_process
        self.n_workers = workers
        self.priority = priority
        self.max_attempts = max_attempts
        self._ctx = uploader_context(start_method)
        self._slots: list[_Slot] = []
        self._pending: collections.deque[Job] = collections.deque()
        # jobs waiting for their ``before`` (run on the dispatcher thread), and those whose runs now
        self._preparing: collections.deque[tuple[Callable[[], None], list[Job]]] = collections.deque()
        self._preparing_now: list[Job] = []
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._stopping = False
        self._closed = False
        self._abandon = False  # set by close() when the queue did not drain in time
        self._thread: threading.Thread | None = None
        self._start_timeout_s = 120.0
        self._hold_s = 0.0
        self._started = threading.Event()  # the start has an outcome: workers up, or _start_error
        self._go = threading.Event()  # the workers may start (``start``'s ``hold_s``)
        self._start_error: BaseException | None = None
        self._start_error_seen = False
        self._internal_errors: list[BaseException] = []
        self.restarts = 0
        self.retries = 0

    # -- life cycle -----------------------------------------------------------------------
    def _spawn(self, index: int) -> _Slot:
        parent, child = self._ctx.Pipe(duplex=True)
        proc: Any
        if self.in_process:
            proc = ThreadWorker(worker_main, (child, WorkerSetup(self.spec, self.priority.nice, index)))
            proc.start()
        else:
            setup = WorkerSetup(self.spec, self.priority.nice, index, trainer_pid=os.getpid(), environ=self.environ,
                                sched_idle=self.priority.sched_idle)
            proc = self._ctx.Process(target=worker_main, args=(child, setup), daemon=True,
                                     name=f"{PROCESS_NAME}-{index}")
            proc.start()
            child.close()
        return _Slot(proc, parent)

    def start(self, *, timeout_s: float = 120.0, wait: bool = True, hold_s: float = 0.0) -> None:
        """Start every worker and have each prove it can write to the root, within ``timeout_s``.

        ``wait``: return once they have, or raise why not (having stopped what was started);
        otherwise return at once and let ``ready`` tell. ``hold_s`` (without ``wait``): the workers
        start that much later, or at ``go`` or ``ready`` if sooner (a restore reads meanwhile).
        """
        self._start_timeout_s = timeout_s
        if wait or hold_s <= 0:
            self.go()
        self._hold_s = hold_s
        self._thread = Thread(target=self._run, name="mpckpt-dispatcher", daemon=True)
        self._thread.start()
        if wait:
            try:
                self.ready()
            except BaseException:
                self.close(timeout_s=5)
                raise

    def go(self) -> None:
        """Let the workers start now (``start``'s ``hold_s``)."""
        self._go.set()

    def ready(self, *, again: bool = True) -> None:
        """Wait until the workers have started (bounded); raise the start's failure.

        ``again``: also a failure raised before (a call that needs the workers); otherwise only
        one nobody has seen yet (a wait, a close).
        """
        if self._thread is None:
            return
        self.go()
        if not self._started.wait(self._start_timeout_s + 30.0):  # the dispatcher keeps its own deadline
            raise WaitTimeoutError(f"the uploader processes did not start within {self._start_timeout_s:.0f}s")
        error = self._start_error
        if error is None or (self._start_error_seen and not again):
            return
        self._start_error_seen = True
        raise error.with_traceback(None)

    def going(self) -> None:
        """Let the workers start now and raise their start's failure if it is known already; never waits
        (a job submitted before the start ends waits in the queue, and fails with that failure)."""
        if self._thread is None:
            return
        self.go()
        if self._started.is_set() and self._start_error is not None:
            self._start_error_seen = True
            raise self._start_error.with_traceback(None)

    def _start_workers(self) -> bool:
        """On the dispatcher thread, before any job: spawn the workers, wait for every ping's answer.

        False when they did not start: a failure (kept for ``ready``; the workers are stopped) or
        a close meanwhile.
        """
        try:
            for index in range(self.n_workers):
                if self._stopping:  # closed while starting: close() stops what was started
                    break
                slot = self._spawn(index)
                with self._lock:
                    self._slots.append(slot)
            return self._await_pings(time.monotonic() + self._start_timeout_s)
        except BaseException as e:
            self._start_error = e
            self._stop_slots(timeout_s=5)
            return False
        finally:
            self._started.set()

    def _await_pings(self, deadline: float) -> bool:
        for slot in self._slots:
            slot.conn.send(("ping", 0))
        waiting = list(self._slots)
        while waiting and not self._stopping:
            ready = mp_wait([self._wake_r, *(s.conn for s in waiting)], timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise WaitTimeoutError(f"uploader process {waiting[0].process.pid} did not start within "
                                       f"{self._start_timeout_s:.0f}s")
            if self._wake_r in ready:  # close() or a submit: look at _stopping again
                with contextlib.suppress(OSError):
                    os.read(self._wake_r, 4096)
            for slot in [s for s in waiting if s.conn in ready]:
                waiting.remove(slot)
                self._check_ping(slot)
        return not waiting

    def _check_ping(self, slot: _Slot) -> None:
        try:
            status, _, payload = slot.conn.recv()
        except (EOFError, OSError) as e:
            slot.process.join(1)
            raise upload_error(
                None, f"{self.spec.root}: an uploader process died while starting (exit code "
                f"{slot.process.exitcode}, start method '{self._ctx.get_start_method()}'); its output above says why",
                e) from e
        if status == "err":
            cause = payload.rebuild()
            raise ConfigError(
                f"{self.spec.root}: the uploader processes cannot write there: {type(cause).__name__}: {cause}. "
                "They run with this process's environment and the storage options given to the Checkpointer"
            ) from cause

    @property
    def pids(self) -> list[int]:
        """The workers' process ids, once started (starts them if held; waits for the start, bounded)."""
        if self._thread is not None:
            self.go()
            self._started.wait(self._start_timeout_s + 30.0)
        with self._lock:
            return [s.process.pid for s in self._slots]

    def close(self, *, timeout_s: float = 30.0) -> None:
        """Stop the workers (after their current job); kill any that do not stop in time.

        Idempotent. If the dispatcher does not finish the queue within ``timeout_s``, the jobs
        still queued or running fail (their callbacks get an ``UploadError``) rather than being
        left unsettled, and the dispatcher stops before the pipes it waits on are closed.
        """
        if self._closed:
            return
        self._closed = True
        self._stopping = True
        self.go()
        self._wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                self._abandon = True  # the dispatcher fails what is left and returns
                self._wake()
                self._thread.join(timeout_s)
        self._stop_slots(timeout_s=timeout_s)
        if self._thread is not None and self._thread.is_alive():
            return  # never close descriptors a running thread may still use (their numbers get reused)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _stop_slots(self, *, timeout_s: float) -> None:
        """Ask every worker to stop; kill those still running after ``timeout_s``."""
        with self._lock:
            slots, self._slots = self._slots, []
        for slot in slots:
            try:
                slot.conn.send(("stop",))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + timeout_s
        for slot in slots:
            slot.process.join(max(0.1, deadline - time.monotonic()))
            if slot.process.is_alive():
                slot.process.kill()
                slot.process.join(5)
            slot.conn.close()

    def _fail_left_over(self) -> None:
        """The pool closes (or its workers did not start) before these jobs finished: fail them,
        so their checkpoints settle."""
        cause = self._start_error
        with self._lock:
            jobs = [*(j for _, waiting in self._preparing for j in waiting), *self._pending,
                    *(s.job for s in self._slots if s.job is not None)]
            self._preparing.clear()
            self._pending.clear()
            for slot in self._slots:
                slot.job = None
        for job in jobs:
            what = job.payload.relpath
            self._callback(job, None, upload_error(
                job.step, f"the uploader pool was closed before {what} was written" if cause is None
                else f"{what} was not written: the uploader processes did not start", cause, shard=what))

    # -- jobs -----------------------------------------------------------------------------
    def submit(self, *jobs: Job, before: Callable[[], None] | None = None) -> None:
        """Queue jobs (one wake-up of the dispatcher for all of them).

        ``before`` runs on the dispatcher thread (in this process, off the caller's thread)
        before any of these jobs is sent: it prepares what they write into (a staging folder).
        If it raises, every one of them fails with that error, unsent.
        """
        self.go()  # (a held start: jobs need the workers now)
        for job in jobs:
            job.id = next(self._ids)
        with self._lock:
            if before is None:
                self._pending.extend(jobs)
            else:
                self._preparing.append((before, list(jobs)))
        self._wake()

    def cancel(self, tag: Any) -> bool:
        """Drop the queued jobs of ``tag`` if none has started and all workers are busy.

        With a worker idle the job is about to start: it is not waiting in a queue.
        """
        with self._lock:
            if any(s.job is None or s.job.tag == tag for s in self._slots) or \
                    any(j.tag == tag for j in self._preparing_now):
                return False
            self._pending = collections.deque(j for j in self._pending if j.tag != tag)
            self._preparing = collections.deque((before, kept) for before, jobs in self._preparing
                                                if (kept := [j for j in jobs if j.tag != tag]))
            return True

    def started(self, tag: Any) -> bool:
        with self._lock:
            return any(s.job is not None and s.job.tag == tag for s in self._slots)

    def busy(self) -> bool:
        with self._lock:
            return bool(self._pending or self._preparing or self._preparing_now) or \
                any(s.job is not None for s in self._slots)

    def take_internal_error(self) -> BaseException | None:
        with self._lock:
            return self._internal_errors.pop(0) if self._internal_errors else None

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # BlockingIOError too: a wake-up is pending already
            os.write(self._wake_w, b"x")

    # -- dispatcher thread ----------------------------------------------------------------
    def _run(self) -> None:
        self._go.wait(self._hold_s)
        if not self._start_workers():
            while not self._stopping:  # no workers: every job fails, until close()
                self._fail_left_over()
                with contextlib.suppress(OSError):
                    if mp_wait([self._wake_r], timeout=1.0):
                        os.read(self._wake_r, 4096)
            self._fail_left_over()
            return
        while True:
            if self._abandon:
                self._fail_left_over()
                return
            with self._lock:
                idle = not self._pending and not self._preparing and all(s.job is None for s in self._slots)
            if self._stopping and idle:
                return
            self._prepare()
            self._dispatch()
            waitables: list[Any] = [self._wake_r]
            for slot in self._slots:
                waitables += [slot.conn, slot.process.sentinel]
            try:
                ready = mp_wait(waitables, timeout=1.0)
            except OSError:
                ready = []
            if self._wake_r in ready:
                with contextlib.suppress(OSError):
                    os.read(self._wake_r, 4096)
            for slot in list(self._slots):
                if slot.conn in ready or slot.process.sentinel in ready:
                    self._service(slot)
            self._kill_overdue()

    def _kill_overdue(self) -> None:
        """A job past its deadline means a hung storage call: kill that worker (then retried)."""
        if self.in_process:
            return  # threads cannot be killed; their storage calls carry their own timeouts
        now = time.monotonic()
        with self._lock:
            for slot in self._slots:
                job = slot.job
                if job is not None and job.timeout_s is not None and not slot.overdue \
                        and now - slot.started > job.timeout_s:
                    slot.overdue = True
                    slot.process.kill()

    def _prepare(self) -> None:
        """Run the ``before`` of queued jobs, then let them be dispatched (or fail them)."""
        while True:
            with self._lock:
                if not self._preparing:
                    return
                before, jobs = self._preparing.popleft()
                self._preparing_now = jobs
            try:
                before()
            except BaseException as e:  # e.g. the staging folder cannot be made: these jobs fail
                with self._lock:
                    self._preparing_now = []
                for job in jobs:
                    self._callback(job, None, e)
                continue
            with self._lock:
                self._pending.extend(jobs)
                self._preparing_now = []

    def _dispatch(self) -> None:
        with self._lock:
            for slot in self._slots:
                if slot.job is None and self._pending:
                    job = self._pending.popleft()
                    job.attempts += 1
                    slot.job = job
                    slot.started = time.monotonic()
                    try:
                        slot.conn.send((job.kind, job.id, job.payload))
                    except (OSError, ValueError):
                        pass  # the sentinel tells us the worker died; the job is retried then

    def _service(self, slot: _Slot) -> None:
        try:
            while slot.conn.poll():
                status, job_id, payload = slot.conn.recv()
                self._finish(slot, status, job_id, payload)
        except (EOFError, OSError):
            pass
        if not slot.process.is_alive():
            self._replace(slot)

    def _finish(self, slot: _Slot, status: str, job_id: int, payload: Any) -> None:
        with self._lock:
            job = slot.job
            slot.job = None
        if job is None or job.id != job_id:
            return
        if status == "ok":
            self._callback(job, payload, None)
        else:
            cause = payload.rebuild() if isinstance(payload, RemoteFailure) else RuntimeError(str(payload))
            self._callback(job, None, cause)

    def _replace(self, slot: _Slot) -> None:
        code = slot.process.exitcode
        cause = (f"was stopped after exceeding its deadline of {slot.job.timeout_s:.0f}s"
                 if slot.overdue and slot.job is not None and slot.job.timeout_s is not None
                 else f"died (exit code {code})")
        slot.process.join(1)
        slot.conn.close()
        with self._lock:
            job, slot.job = slot.job, None
            index = self._slots.index(slot)
        self.restarts += 1
        if not self._stopping:
            self._slots[index] = self._spawn(index)
        else:
            self._slots.pop(index)
        if job is None:
            return
        if job.attempts < self.max_attempts and not self._stopping:
            self.retries += 1
            log.warning("mpckpt: uploader process %s while writing %s of step %s; writing it again "
                        "(attempt %d of %d)", cause, job.payload.relpath, job.step, job.attempts + 1,
                        self.max_attempts)
            with self._lock:
                self._pending.appendleft(job)
            return
        what = job.payload.relpath
        self._callback(job, None, upload_error(
            job.step, f"uploader process {cause} while writing {what}; tried {job.attempts} time(s)", shard=what))

    def _callback(self, job: Job, result: dict[str, Any] | None, error: BaseException | None) -> None:
        try:
            job.on_done(job, result, error)
        except BaseException as e:  # never lose it: surfaced at the next save/wait/exit
            with self._lock:
                self._internal_errors.append(e)
