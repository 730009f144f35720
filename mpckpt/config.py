"""Frozen settings of a Checkpointer and where each comes from: argument > MPCKPT_* > default.

The environment is passed in (``Config.resolve(..., environ=os.environ)``) so tests never
touch the real one. Every bad value raises ``ConfigError`` naming the argument or variable
and saying what a good value looks like, before anything is written.

The default memory budget comes from what the machine really has: half the available
memory, no more than 80% of free space in /dev/shm, and no more than half of a cgroup v2
memory limit when one is set.
"""

from __future__ import annotations

import enum
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import psutil

from mpckpt.errors import ConfigError

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")
MIN_BUDGET_BYTES = 1 << 20
MAX_WORKERS = 64


class UploadMode(str, enum.Enum):
    """When ``save``/``report`` return (the names follow Ray Train's ``checkpoint_upload_mode``)."""

    SYNC = "sync"            # after the checkpoint is committed
    ASYNC = "async"          # after the snapshot is in shared memory
    NO_UPLOAD = "no_upload"  # the files are already where they belong: only commit them


class BudgetPolicy(str, enum.Enum):
    """What ``save`` does when the memory budget is full."""

    BLOCK = "block"          # wait for uploads to free memory
    SKIP = "skip"            # drop this checkpoint (warning + counter)
    COALESCE = "coalesce"    # replace a pending, not yet started checkpoint with this one


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


def _parse_bool(value: Any, *, setting: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"{setting}={value!r} is not a boolean; use 1/0, true/false")


@dataclass(frozen=True)
class Config:
    """Everything a Checkpointer needs to know, validated."""

    memory_budget_bytes: int
    workers: int
    policy: BudgetPolicy = BudgetPolicy.BLOCK
    overlap: bool = False
    allow_pickle: bool = False
    keep_last: int | None = None
    timeout_s: float = 3600.0
    max_job_attempts: int = 3
    start_method: str = "forkserver"
    nice: int = 10
    job_timeout_s: float = 300.0

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
        environ: Mapping[str, str] | None = None,
    ) -> Config:
        """Combine arguments with ``MPCKPT_*`` variables; arguments win."""
        env = os.environ if environ is None else environ

        def pick(arg: Any, var: str) -> tuple[Any, str]:
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
        n_workers = 2 if raw in (None, "") else _parse_int(raw, setting=name, low=1, high=MAX_WORKERS)
        raw, name = pick(policy, "MPCKPT_POLICY")
        chosen_policy = BudgetPolicy.BLOCK if raw in (None, "") else _parse_enum(BudgetPolicy, raw, setting=name)
        raw, name = pick(overlap, "MPCKPT_OVERLAP")
        use_overlap = False if raw is None else _parse_bool(raw, setting=name)
        raw, name = pick(timeout_s, "MPCKPT_TIMEOUT_S")
        timeout = 3600.0 if raw in (None, "") else _parse_float(raw, setting=name)
        raw, name = pick(job_timeout_s, "MPCKPT_JOB_TIMEOUT_S")
        job_timeout = 300.0 if raw in (None, "") else _parse_float(raw, setting=name)
        raw, name = pick(start_method, "MPCKPT_START_METHOD")
        method = "forkserver" if raw in (None, "") else str(raw)
        if method not in ("fork", "spawn", "forkserver"):
            raise ConfigError(f"{name}={raw!r} is not one of 'fork', 'spawn', 'forkserver'")
        keep = None
        if keep_last is not None:
            keep = _parse_int(keep_last, setting="keep_last", low=1, high=1 << 31)
        return cls(
            memory_budget_bytes=budget,
            workers=n_workers,
            policy=chosen_policy,
            overlap=use_overlap,
            allow_pickle=bool(allow_pickle),
            keep_last=keep,
            timeout_s=timeout,
            job_timeout_s=job_timeout,
            start_method=method,
        )
