"""What ``save``/``report`` hand back: a future of one checkpoint and its figures.

Every save records its own timings: ``blocked_ms`` (how long the caller waited inside
``save``), ``snapshot_ms`` (the copy into shared memory), ``persist_ms`` (from the end of the
snapshot to the commit), bytes and MB/s, and how far durability lagged behind it:
``durable_ms`` (from the ``save`` call until the checkpoint was committed: what a crash in
between would have lost) and ``waiting`` (how many later saves were already taken, not yet
durable, when it committed). They are on the future and in ``Checkpointer.stats``, whose
``waiting`` counts the saves taken and not yet durable right now.

A background failure must surface exactly once: ``SaveFuture`` remembers whether the caller
already saw the exception through ``result()``/``exception()``, and the checkpointer only
raises the failures nobody has seen yet.
"""

from __future__ import annotations

import concurrent.futures
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from mpckpt.errors import WaitTimeoutError


@dataclass
class SaveStats:
    step: int
    status: str = "pending"  # pending | committed | failed | skipped | coalesced
    bytes: int = 0
    blocked_ms: float = 0.0
    snapshot_ms: float = 0.0
    persist_ms: float = 0.0
    barrier_ms: float = 0.0  # overlapped saves: time optimizer.step() waited for the copy
    written_bytes: int = 0   # bytes actually sent to storage (referenced files excluded)
    durable_ms: float = 0.0  # from the save call until its commit (0 until committed)
    waiting: int = 0         # later saves taken and not yet durable when this one committed
    peer_copies: int = 0     # copies of its snapshot in place in other nodes' memory (``peer_copies``)
    # when ``save`` was called (``time.perf_counter``): where ``durable_ms`` starts
    saved_at: float = field(default_factory=time.perf_counter, repr=False, compare=False)

    @property
    def mb_per_s(self) -> float:
        return self.written_bytes / 1e6 / (self.persist_ms / 1e3) if self.persist_ms > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "step": self.step, "status": self.status, "bytes": self.bytes, "written_bytes": self.written_bytes,
            "blocked_ms": round(self.blocked_ms, 3), "snapshot_ms": round(self.snapshot_ms, 3),
            "persist_ms": round(self.persist_ms, 3), "barrier_ms": round(self.barrier_ms, 3), "mb_per_s": round(self.mb_per_s, 1),
            "durable_ms": round(self.durable_ms, 3), "waiting": self.waiting, "peer_copies": self.peer_copies,
        }


@dataclass
class ValidationStats:
    """One run of ``validate=`` on a committed checkpoint (``Checkpointer.stats.validations``)."""

    step: int
    status: str = "pending"  # pending | ok | failed
    metrics: dict[str, Any] = field(default_factory=dict)
    error: BaseException | None = None  # a ValidationError naming the step, chained to the cause
    seconds: float = 0.0
    pid: int | None = None              # the validator process that ran it


@dataclass(frozen=True)
class SaveResult:
    step: int
    name: str | None          # folder of the committed checkpoint; None if skipped/coalesced
    stats: SaveStats


class SaveFuture:
    """The outcome of one ``save``/``report``; ``result()`` waits for the commit."""

    def __init__(self, stats: SaveStats) -> None:
        self.stats = stats
        self._future: concurrent.futures.Future[SaveResult] = concurrent.futures.Future()
        self._observed = False
        self._lock = threading.Lock()
        self.on_wait: Any = None  # called when someone waits for it (a paced copy to other nodes hurries)

    @property
    def step(self) -> int:
        return self.stats.step

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> SaveResult:
        if self.on_wait is not None and not self._future.done():
            self.on_wait()
        try:
            return self._future.result(timeout)
        except concurrent.futures.TimeoutError as e:
            raise WaitTimeoutError(f"step {self.step}: not committed within {timeout}s") from e
        except BaseException:
            self._observed = True
            raise

    def exception(self, timeout: float | None = None) -> BaseException | None:
        exc = self._future.exception(timeout)
        if exc is not None:
            self._observed = True
        return exc

    def add_done_callback(self, fn: Any) -> None:
        self._future.add_done_callback(lambda _f: fn(self))

    # -- internal ---------------------------------------------------------------------------
    def _resolve(self, name: str | None) -> None:
        with self._lock:
            if not self._future.done():
                self._future.set_result(SaveResult(self.step, name, self.stats))

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            if not self._future.done():
                self.stats.status = "failed"
                self._future.set_exception(exc)

    def _mark_seen(self) -> None:
        """The caller already got this save's error synchronously."""
        self._observed = True

    def _unseen_exception(self) -> BaseException | None:
        """The failure, once, if the caller never looked at it."""
        if not self._future.done() or self._observed:
            return None
        exc = self._future.exception(0)
        if exc is not None:
            self._observed = True
        return exc


@dataclass(frozen=True)
class LastRestore:
    """What the last ``restore`` did: the step, where it came from (``"memory"``: this node's
    shared memory, ``"peer"``, or ``"storage"``), how long it took and how many bytes it read."""

    step: int
    source: str
    seconds: float
    bytes: int

    def __repr__(self) -> str:  # (seconds to the millisecond: a restore is not timed closer than that)
        return f"LastRestore(step={self.step}, source={self.source!r}, seconds={self.seconds:.3f}, bytes={self.bytes})"

    def __str__(self) -> str:
        return f"step {self.step} restored from {self.source} in {self.seconds:.2f} s ({size_text(self.bytes)})"


def size_text(nbytes: float) -> str:
    """``nbytes`` for people: 48 bytes, 12.3 KiB, 1.5 GiB."""
    if nbytes < 1024:
        return f"{int(nbytes)} bytes"
    units = ["KiB", "MiB", "GiB", "TiB"]
    nbytes /= 1024
    while nbytes >= 1024 and len(units) > 1:
        nbytes /= 1024
        units.pop(0)
    return f"{nbytes:.1f} {units[0]}"


@dataclass
class CheckpointerStats:
    """Figures of every save of one checkpointer, and its counters."""

    saves: list[SaveStats] = field(default_factory=list)
    reported: list[dict[str, Any]] = field(default_factory=list)  # report(metrics) without a checkpoint
    validations: list[ValidationStats] = field(default_factory=list)  # validate=, in commit order
    worker_restarts: int = 0
    job_retries: int = 0
    peak_shm_bytes: int = 0
    restored_bytes: int = 0  # bytes the last restore() read (a rank of a job: about its share)
    last_restore: LastRestore | None = None  # None: no restore yet, or there was nothing to restore

    def count(self, status: str) -> int:
        return sum(1 for s in self.saves if s.status == status)

    @property
    def committed(self) -> int:
        return self.count("committed")

    @property
    def skipped(self) -> int:
        return self.count("skipped")

    @property
    def coalesced(self) -> int:
        return self.count("coalesced")

    @property
    def failed(self) -> int:
        return self.count("failed")

    @property
    def waiting(self) -> int:
        """Saves taken and not yet durable (neither committed, failed nor dropped) right now:
        a crash now loses everything since the newest committed step, these included."""
        return self.count("pending")

    def median(self, figure: str) -> float:
        values = [getattr(s, figure) for s in self.saves if s.status == "committed"]
        return statistics.median(values) if values else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "committed": self.committed, "skipped": self.skipped, "coalesced": self.coalesced,
            "failed": self.failed, "worker_restarts": self.worker_restarts, "job_retries": self.job_retries,
            "peak_shm_bytes": self.peak_shm_bytes,
            "median_blocked_ms": round(self.median("blocked_ms"), 3),
            "median_persist_ms": round(self.median("persist_ms"), 3),
            "median_durable_ms": round(self.median("durable_ms"), 3), "waiting": self.waiting,
            "saves": [s.as_dict() for s in self.saves],
            "reported": list(self.reported),
        }
