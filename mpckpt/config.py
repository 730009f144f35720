"""Every setting of mpckpt and where each comes from: argument > MPCKPT_* > default.

``Config`` holds the frozen settings of a Checkpointer; ``progress_enabled`` answers the one
setting read outside it (progress bars while loading). Each default is written once, as a
``DEFAULT_*`` constant. No other module reads an ``MPCKPT_*`` variable: a storage backend
gets its settings (``direct_io``) as storage options.

The environment is passed in (``Config.resolve(..., environ=os.environ)``) so tests never
touch the real one. Every bad value raises ``ConfigError`` naming the argument or variable
and saying what a good value looks like, before anything is written. A variable set to the
empty string counts as unset.

The default memory budget comes from what the machine really has: half the available
memory, no more than 80% of free space in /dev/shm, and no more than half of a cgroup v2
memory limit when one is set.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
import shutil
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import psutil

from mpckpt.errors import ConfigError
from mpckpt.policies.retention import KeepAny, KeepLast, RetentionPolicy
from mpckpt.policies.triggers import Trigger, check_trigger

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")
MIN_BUDGET_BYTES = 1 << 20
MAX_WORKERS = 64
START_METHODS = ("fork", "spawn", "forkserver")


class UploadMode(str, enum.Enum):
    """When ``save``/``report`` return (the names follow Ray Train's ``checkpoint_upload_mode``)."""

    SYNC = "sync"            # after the checkpoint is committed
    ASYNC = "async"          # after the snapshot is in shared memory
    NO_UPLOAD = "no_upload"  # the files are already where they belong: only commit them
    MEMORY = "memory"        # kept in this node's shared memory only, never uploaded (``keep_in_memory``)


class UploaderPriority(str, enum.Enum):
    """How the uploader processes share the CPU with training (``uploader_priority``).

    The trade-off: the lower they run, the less a save slows the training steps, and the
    longer a checkpoint takes to become durable on a machine whose cores training keeps busy
    (saves then pile up in shared memory, and a crash loses every step since the newest
    durable one).
    """

    IDLE = "idle"      # SCHED_IDLE (only CPU time nothing else wants) and nice 10
    LOW = "low"        # nice 10 under the normal scheduler: a smaller share, never starved
    NORMAL = "normal"  # as training: an equal share

    @property
    def nice(self) -> int:
        """How much the uploader raises its nice value above the training process's."""
        return 0 if self is UploaderPriority.NORMAL else DEFAULT_NICE

    @property
    def sched_idle(self) -> bool:
        """Whether the uploader asks for ``SCHED_IDLE`` (where Linux offers it)."""
        return self is UploaderPriority.IDLE


class BudgetPolicy(str, enum.Enum):
    """What ``save`` does when the memory budget is full."""

    BLOCK = "block"          # wait for uploads to free memory
    SKIP = "skip"            # drop this checkpoint (warning + counter)
    COALESCE = "coalesce"    # replace a pending, not yet started checkpoint with this one


# The defaults, each written once (the memory budget's is measured: ``default_budget_bytes``).
DEFAULT_WORKERS = 2
DEFAULT_POLICY = BudgetPolicy.BLOCK
DEFAULT_OVERLAP = False
DEFAULT_TIMEOUT_S = 3600.0
DEFAULT_JOB_TIMEOUT_S = 300.0
DEFAULT_VALIDATE_TIMEOUT_S = 3600.0  # one run of validate= (then its process is stopped)
DEFAULT_MAX_JOB_ATTEMPTS = 3
DEFAULT_START_METHOD = "forkserver"
DEFAULT_NICE = 10          # the validator's, and the uploaders' below 'normal' priority
DEFAULT_UPLOADER_PRIORITY = UploaderPriority.IDLE
DEFAULT_DIRECT_IO = True   # local files bypass the page cache (O_DIRECT) where the OS has it
DEFAULT_PROGRESS = True    # a progress bar while loading, when stderr is a terminal
# the newest complete snapshot stays in shared memory until a newer one is: a crash costs a
# restart from memory, not the steps since the last upload, for one more slab of the budget
DEFAULT_KEEP_IN_MEMORY = True
DEFAULT_PEER_COPIES = 0
MAX_PEER_COPIES = 8


def parse_bytes(value: Any, *, setting: str, available: int | None = None) -> int:
    """Parse ``512MiB``, ``8GiB``, ``1.5GB``, ``1048576`` or a fraction like ``0.5``.

    A plain number below 1 is a fraction of ``available`` (bytes of available memory).
    """
    if isinstance(value, bool):
        raise ConfigError(f"{setting}={value!r} is not a size; use bytes or a string like '8GiB'")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        if not m or m.group(2).lower() not in _UNITS:
            raise ConfigError(
                f"{setting}={value!r} is not a size; use a number of bytes, a unit such as '512MiB' or '8GiB', "
                "or a fraction of available memory such as '0.5'"
            )
        number, unit = float(m.group(1)), m.group(2).lower()
    else:
        raise ConfigError(f"{setting}={value!r} is not a size; use bytes or a string like '8GiB'")
    if number != number or number <= 0 or number == float("inf"):
        raise ConfigError(f"{setting}={value!r} must be positive")
    if unit == "" and number < 1:
        if available is None:
            available = psutil.virtual_memory().available
        return int(number * available)
    if unit == "" and number != int(number):
        raise ConfigError(f"{setting}={value!r}: a byte count must be a whole number (or a fraction below 1)")
    return int(number * _UNITS[unit])


def _cgroup_limit_bytes() -> int | None:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < (1 << 60):
            return int(text)
    return None


def shm_free_bytes() -> int | None:
    try:
        return shutil.disk_usage("/dev/shm").free
    except OSError:
        return None


def default_budget_bytes() -> int:
    """Half of available memory, capped by /dev/shm free space and the cgroup limit."""
    candidates = [psutil.virtual_memory().available // 2]
    shm = shm_free_bytes()
    if shm is not None:
        candidates.append(int(shm * 0.8))
    cgroup = _cgroup_limit_bytes()
    if cgroup is not None:
        candidates.append(cgroup // 2)
    return max(MIN_BUDGET_BYTES, min(candidates))


def _parse_int(value: Any, *, setting: str, low: int, high: int) -> int:
    try:
        if isinstance(value, bool):
            raise ValueError
        number = int(value) if not isinstance(value, str) else int(value.strip())
    except (TypeError, ValueError):
        raise ConfigError(f"{setting}={value!r} is not a whole number; use {low}..{high}") from None
    if not low <= number <= high:
        raise ConfigError(f"{setting}={value!r} is out of range; use {low}..{high}")
    return number


def _parse_float(value: Any, *, setting: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{setting}={value!r} is not a number of seconds") from None
    if not number > 0 or number == float("inf"):
        raise ConfigError(f"{setting}={value!r} must be a positive, finite number of seconds")
    return number


def _parse_enum(enum_type: type[enum.Enum], value: Any, *, setting: str) -> Any:
    if isinstance(value, enum_type):
        return value
    try:
        return enum_type(str(value).strip().lower())
    except ValueError:
        choices = ", ".join(repr(m.value) for m in enum_type)  # type: ignore[attr-defined]
        raise ConfigError(f"{setting}={value!r} is not one of {choices}") from None


def _parse_priority(value: Any, *, setting: str) -> UploaderPriority:
    try:
        return UploaderPriority(value if isinstance(value, UploaderPriority) else str(value).strip().lower())
    except ValueError:
        raise ConfigError(f"{setting}={value!r} is not an uploader priority; use 'idle' (the default: only CPU time "
                          "training leaves free), 'low' (nice 10: a smaller share) or 'normal' (an equal share "
                          "with training)") from None


def _parse_bool(value: Any, *, setting: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"{setting}={value!r} is not a boolean; use 1/0, true/false")


def progress_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether loading may show a progress bar: ``MPCKPT_PROGRESS`` (default on).

    The caller still shows none when stderr is not a terminal.
    """
    env = os.environ if environ is None else environ
    raw = env.get("MPCKPT_PROGRESS")
    return DEFAULT_PROGRESS if raw in (None, "") else _parse_bool(raw, setting="MPCKPT_PROGRESS")


@dataclass(frozen=True)
class Config:
    """Everything a Checkpointer needs to know, validated."""

    memory_budget_bytes: int
    workers: int
    policy: BudgetPolicy = DEFAULT_POLICY
    overlap: bool = DEFAULT_OVERLAP
    allow_pickle: bool = False
    keep_last: int | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    max_job_attempts: int = DEFAULT_MAX_JOB_ATTEMPTS
    start_method: str = DEFAULT_START_METHOD
    nice: int = DEFAULT_NICE  # the validator process's
    uploader_priority: UploaderPriority = DEFAULT_UPLOADER_PRIORITY
    job_timeout_s: float = DEFAULT_JOB_TIMEOUT_S
    direct_io: bool = DEFAULT_DIRECT_IO  # asked for; the local backend also needs os.O_DIRECT
    keep: RetentionPolicy | None = None
    trigger: Trigger | None = None
    validate: Any = None  # fn(Checkpoint) -> {name: number}, run in the validator process after each commit
    validate_timeout_s: float = DEFAULT_VALIDATE_TIMEOUT_S
    keep_in_memory: bool = DEFAULT_KEEP_IN_MEMORY
    peer_copies: int = DEFAULT_PEER_COPIES  # copies of each rank's kept snapshot in other nodes' memory

    @property
    def retention(self) -> RetentionPolicy | None:
        """What the committer keeps: ``keep``, and ``keep_last`` as ``KeepLast`` (either keeps)."""
        parts = [p for p in (KeepLast(self.keep_last) if self.keep_last is not None else None, self.keep)
                 if p is not None]
        return KeepAny(*parts) if len(parts) > 1 else (parts[0] if parts else None)

    def job_deadline_s(self, nbytes: int) -> float:
        """How long one file may take: ``job_timeout_s`` plus a second per MB (1 MB/s floor)."""
        return self.job_timeout_s + nbytes / 1e6

    @classmethod
    def resolve(
        cls,
        *,
        memory_budget: Any = None,
        workers: Any = None,
        policy: Any = None,
        overlap: Any = None,
        allow_pickle: bool = False,
        keep_last: Any = None,
        timeout_s: Any = None,
        job_timeout_s: Any = None,
        start_method: Any = None,
        direct_io: Any = None,
        keep: Any = None,
        trigger: Any = None,
        validate: Any = None,
        validate_timeout_s: Any = None,
        uploader_priority: Any = None,
        keep_in_memory: Any = None,
        peer_copies: Any = None,
        environ: Mapping[str, str] | None = None,
    ) -> Config:
        """Combine arguments with ``MPCKPT_*`` variables; arguments win."""
        env = os.environ if environ is None else environ

        def pick(arg: Any, var: str) -> tuple[Any, str]:
            """The raw value and the name to blame for it: the argument if given, else the variable."""
            if arg is not None:
                return arg, var.removeprefix("MPCKPT_").lower()
            return env.get(var), var

        raw, name = pick(memory_budget, "MPCKPT_MEMORY_BUDGET")
        if raw is None or raw == "":
            budget = default_budget_bytes()
        else:
            budget = parse_bytes(raw, setting=name)
            if budget < MIN_BUDGET_BYTES:
                raise ConfigError(f"{name}={raw!r} is below the 1MiB minimum; give at least '1MiB'")
        raw, name = pick(workers, "MPCKPT_WORKERS")
        n_workers = DEFAULT_WORKERS if raw in (None, "") else _parse_int(raw, setting=name, low=1, high=MAX_WORKERS)
        raw, name = pick(policy, "MPCKPT_POLICY")
        chosen_policy = DEFAULT_POLICY if raw in (None, "") else _parse_enum(BudgetPolicy, raw, setting=name)
        raw, name = pick(overlap, "MPCKPT_OVERLAP")
        use_overlap = DEFAULT_OVERLAP if raw in (None, "") else _parse_bool(raw, setting=name)
        raw, name = pick(timeout_s, "MPCKPT_TIMEOUT_S")
        timeout = DEFAULT_TIMEOUT_S if raw in (None, "") else _parse_float(raw, setting=name)
        raw, name = pick(job_timeout_s, "MPCKPT_JOB_TIMEOUT_S")
        job_timeout = DEFAULT_JOB_TIMEOUT_S if raw in (None, "") else _parse_float(raw, setting=name)
        raw, name = pick(start_method, "MPCKPT_START_METHOD")
        method = DEFAULT_START_METHOD if raw in (None, "") else str(raw)
        if method not in START_METHODS:
            raise ConfigError(f"{name}={raw!r} is not one of {', '.join(map(repr, START_METHODS))}")
        raw, name = pick(direct_io, "MPCKPT_DIRECT_IO")
        use_direct_io = DEFAULT_DIRECT_IO if raw in (None, "") else _parse_bool(raw, setting=name)
        raw, name = pick(uploader_priority, "MPCKPT_UPLOADER_PRIORITY")
        priority = DEFAULT_UPLOADER_PRIORITY if raw in (None, "") else _parse_priority(raw, setting=name)
        raw, name = pick(validate_timeout_s, "MPCKPT_VALIDATE_TIMEOUT_S")
        validate_timeout = DEFAULT_VALIDATE_TIMEOUT_S if raw in (None, "") else _parse_float(raw, setting=name)
        raw, name = pick(keep_in_memory, "MPCKPT_KEEP_IN_MEMORY")
        keeping = DEFAULT_KEEP_IN_MEMORY if raw in (None, "") else _parse_bool(raw, setting=name)
        raw, name = pick(peer_copies, "MPCKPT_PEER_COPIES")
        copies = DEFAULT_PEER_COPIES if raw in (None, "") else _parse_int(raw, setting=name, low=0,
                                                                          high=MAX_PEER_COPIES)
        if copies and not keeping:
            raise ConfigError(f"{name}={raw!r} copies the snapshot kept in memory to other nodes, but keep_in_memory "
                              "is off; turn keep_in_memory on (MPCKPT_KEEP_IN_MEMORY=1) or set peer_copies to 0")
        if validate is not None and not callable(validate):
            raise ConfigError(f"validate={validate!r} is not callable; give a function fn(checkpoint) -> dict of "
                              "metric names to numbers")
        last = None if keep_last is None else _parse_int(keep_last, setting="keep_last", low=1, high=1 << 31)
        if keep is not None and not isinstance(keep, RetentionPolicy):
            raise ConfigError(f"keep={keep!r} is not a retention policy; give one such as mpckpt.KeepLast(3), "
                              "or several combined with |: mpckpt.KeepLast(3) | mpckpt.KeepBest(1, 'val_loss')")
        return cls(
            memory_budget_bytes=budget,
            workers=n_workers,
            policy=chosen_policy,
            overlap=use_overlap,
            allow_pickle=bool(allow_pickle),
            keep_last=last,
            keep=keep,
            trigger=check_trigger(trigger),
            validate=validate,
            validate_timeout_s=validate_timeout,
            timeout_s=timeout,
            job_timeout_s=job_timeout,
            start_method=method,
            direct_io=use_direct_io,
            uploader_priority=priority,
            keep_in_memory=keeping,
            peer_copies=copies,
        )


def fit_budget_to_shm(config: Config) -> Config:
    """``config`` with a memory budget /dev/shm can hold: an error if it holds almost nothing.

    Slabs live in /dev/shm. With less free there than the budget, saves stream through what is
    there (a warning, and the budget lowered to 90% of it); with less than 64 MiB (or the
    budget, if smaller) a ``ConfigError`` says how to enlarge it.
    """
    free = shm_free_bytes()
    if free is None:
        return config
    if free < min(config.memory_budget_bytes, 64 << 20):
        raise ConfigError(
            f"/dev/shm has only {free >> 20} MiB free, below the memory budget; enlarge it "
            "(docker: --shm-size=8g) or lower memory_budget / MPCKPT_MEMORY_BUDGET"
        )
    if free < config.memory_budget_bytes:
        warnings.warn(
            f"mpckpt: /dev/shm has {free >> 20} MiB free, less than the memory budget "
            f"({config.memory_budget_bytes >> 20} MiB); saves will stream through what is there",
            stacklevel=4,
        )
        return dataclasses.replace(config, memory_budget_bytes=int(free * 0.9))
    return config
