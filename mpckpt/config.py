"""Every setting of mpckpt, declared once, and where each comes from: argument > MPCKPT_* > default.

``SETTINGS`` declares each one (name, keyword group, type, default, variable, check, one line
of doc); ``Config.resolve``, the keyword groups (``mpckpt.options``), the ``Checkpointer``
keywords and docs/guide/settings.md follow it, and tests/unit/test_settings.py keeps them equal.
``Config`` holds the frozen settings of a Checkpointer; the two read outside it go through
their declaration too (``progress_enabled``; ``MPCKPT_NODE_ID`` in ``_peer.node``). Each
default is written once, as a ``DEFAULT_*`` constant or a declared one. No other module reads
an ``MPCKPT_*`` variable: a storage backend gets its settings (``direct_io``) as storage options.

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
from collections.abc import Callable, Mapping, Sequence
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


def _parse_priority(value: Any, setting: str) -> UploaderPriority:
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


def _parse_budget(value: Any, setting: str) -> int:
    budget = parse_bytes(value, setting=setting)
    if budget < MIN_BUDGET_BYTES:
        raise ConfigError(f"{setting}={value!r} is below the 1MiB minimum; give at least '1MiB'")
    return budget


def _parse_start_method(value: Any, setting: str) -> str:
    if str(value) not in START_METHODS:
        raise ConfigError(f"{setting}={value!r} is not one of {', '.join(map(repr, START_METHODS))}")
    return str(value)


def _parse_callable(value: Any, setting: str) -> Any:
    if not callable(value):
        raise ConfigError(f"{setting}={value!r} is not callable; give a function fn(checkpoint) -> dict of "
                          "metric names to numbers")
    return value


def _parse_keep(value: Any, setting: str) -> RetentionPolicy:
    if not isinstance(value, RetentionPolicy):
        raise ConfigError(f"{setting}={value!r} is not a retention policy; give one such as mpckpt.KeepLast(3), "
                          "or several combined with |: mpckpt.KeepLast(3) | mpckpt.KeepBest(1, 'val_loss')")
    return value


def _text(value: Any, setting: str) -> str:
    return str(value).strip()


def _trigger(value: Any, setting: str) -> Trigger | None:
    return check_trigger(value)


def _as_given(value: Any, setting: str) -> Any:
    return value  # checked where the root opens: preemption by parse_signals, process_group by RankGroup


@dataclass(frozen=True)
class Setting:
    """One setting, declared once: ``Config.resolve``, the keyword groups (``mpckpt.options``), the
    ``Checkpointer`` keywords and the settings page (docs/guide/settings.md, checked by a test) read it."""

    name: str                            # the Checkpointer keyword (and the Config field, unless ``stored_as``)
    type: str                            # what a caller gives (the keyword's annotation, less ``| None``)
    parse: Callable[[Any, str], Any]     # (raw value, the name to blame) -> the value, or ConfigError
    default: Any                         # when neither an argument nor the variable gives one
    default_doc: str                     # the default, as the settings page says it
    doc: str                             # one line for the settings page (markdown)
    env: str | None = None               # the MPCKPT_* variable, if any
    group: str | None = None             # the keyword group (``memory=mpckpt.Memory(...)``), None: top level
    field: str | None = None             # its name inside the group
    measure: Callable[[], Any] | None = None  # a default measured on this machine, in place of ``default``
    stored_as: str | None = None         # the Config field, when it is not ``name``
    keyword: bool = True                 # a Checkpointer keyword (False: a variable only)
    in_config: bool = True               # held by Config (False: read where it is used, by ``value``)

    def value(self, given: Any, env: Mapping[str, str]) -> Any:
        """The argument if given, else the variable if set (and not empty), else the default."""
        if given is not None:
            return self.parse(given, self.name)
        raw = env.get(self.env) if self.env else None
        if raw not in (None, ""):
            return self.parse(raw, self.env or self.name)
        return self.measure() if self.measure is not None else self.default


def _int_in(low: int, high: int) -> Callable[[Any, str], int]:
    return lambda value, setting: _parse_int(value, setting=setting, low=low, high=high)


def _float(value: Any, setting: str) -> float:
    return _parse_float(value, setting=setting)


def _bool(value: Any, setting: str) -> bool:
    return _parse_bool(value, setting=setting)


def _enum(kind: type[enum.Enum]) -> Callable[[Any, str], Any]:
    return lambda value, setting: _parse_enum(kind, value, setting=setting)


_PRIORITY = "[Priority](saving.md#priority-training-speed-against-work-a-crash-loses)"
_RESTART = "[Restarting from memory after a crash](restoring.md#restarting-from-memory-after-a-crash)"
_NODE_LOSS = "[Surviving a node loss](jobs-and-nodes.md#surviving-a-node-loss)"

# INVARIANT: every setting is declared here, once; its order is the settings page's.
SETTINGS: tuple[Setting, ...] = (
    Setting("memory_budget", "int | str | float", _parse_budget, None, "half of available memory, capped by "
            "/dev/shm and the cgroup limit", "shared memory for every snapshot in flight: bytes, `'8GiB'`, or a "
            "fraction of available memory such as `0.5`", env="MPCKPT_MEMORY_BUDGET", group="memory",
            field="budget", measure=default_budget_bytes, stored_as="memory_budget_bytes"),
    Setting("policy", "str | BudgetPolicy", _enum(BudgetPolicy), DEFAULT_POLICY, "`block`", "what `save` does "
            "when the budget is full: `block` (wait), `skip` (drop this one) or `coalesce` (replace a pending one)",
            env="MPCKPT_POLICY", group="memory", field="policy"),
    Setting("overlap", "bool", _bool, DEFAULT_OVERLAP, "off", "copy parameters and optimizer state in the "
            "background until the next `optimizer.step()`", env="MPCKPT_OVERLAP", group="memory", field="overlap"),
    Setting("keep_in_memory", "bool", _bool, DEFAULT_KEEP_IN_MEMORY, "on", "the newest complete snapshot stays in "
            f"shared memory for a restart on this node; see {_RESTART}", env="MPCKPT_KEEP_IN_MEMORY",
            group="memory", field="keep"),
    Setting("workers", "int", _int_in(1, MAX_WORKERS), DEFAULT_WORKERS, "2", "uploader processes (1-64)",
            env="MPCKPT_WORKERS", group="uploads", field="workers"),
    Setting("uploader_priority", "str | UploaderPriority", _parse_priority, DEFAULT_UPLOADER_PRIORITY,
            "`idle`", f"how uploaders share the CPU with training: `idle`, `low` or `normal`; see {_PRIORITY}",
            env="MPCKPT_UPLOADER_PRIORITY", group="uploads", field="priority"),
    Setting("start_method", "str", _parse_start_method, DEFAULT_START_METHOD, "`forkserver`", "how uploader "
            "processes start: `forkserver`, `spawn` or `fork`; see [Uploader processes](saving.md#how-they-start)",
            env="MPCKPT_START_METHOD", group="uploads", field="start_method"),
    Setting("job_timeout_s", "float", _float, DEFAULT_JOB_TIMEOUT_S, "300", "the deadline of one file's upload, "
            "plus a second per MB", env="MPCKPT_JOB_TIMEOUT_S", group="uploads", field="timeout_s"),
    Setting("keep_last", "int", _int_in(1, 1 << 31), None, "keep every checkpoint", "keep the newest N committed "
            "checkpoints (with `keep`, what either keeps stays)", group="retention", field="keep_last"),
    Setting("keep", "RetentionPolicy", _parse_keep, None, "no policy", "a retention policy: `KeepLast(3) | "
            "KeepBest(2, 'val_loss') | KeepEvery(10_000)`", group="retention", field="keep"),
    Setting("trigger", "Trigger", _trigger, None, "none: every `save` saves", "when a save is due: "
            "`EveryNSteps(500) | EveryNSeconds(1800)` (`save(..., force=True)` saves regardless)",
            group="retention", field="trigger"),
    Setting("process_group", "Any", _as_given, None, "the default group when torch.distributed is initialized, "
            "else none", "the ranks that save together; `False`: this process alone", group="job",
            field="process_group"),
    Setting("peer_copies", "int", _int_in(0, MAX_PEER_COPIES), DEFAULT_PEER_COPIES, "0", "copies of each rank's "
            f"kept snapshot in other nodes' memory (0-8; needs `keep_in_memory`); see {_NODE_LOSS}",
            env="MPCKPT_PEER_COPIES", group="job", field="peer_copies"),
    Setting("timeout_s", "float", _float, DEFAULT_TIMEOUT_S, "3600", "the longest any wait may take",
            env="MPCKPT_TIMEOUT_S"),
    Setting("allow_pickle", "bool", _bool, False, "off", "values JSON cannot hold are pickled, and loading "
            "unpickles them (run code from storage only if you trust it)"),
    Setting("validate", "Callable[[Checkpoint], Mapping[str, float]]", _parse_callable, None, "none",
            "`fn(checkpoint) -> {name: number}` after each commit, in a process of its own"),
    Setting("validate_timeout_s", "float", _float, DEFAULT_VALIDATE_TIMEOUT_S, "3600", "the longest one validation "
            "may run", env="MPCKPT_VALIDATE_TIMEOUT_S"),
    Setting("preemption", "bool | Sequence[int | str]", _as_given, False, "off", "`True`: SIGTERM (or a "
            "list of signals) makes the next `save` a due, synchronous one"),
    Setting("node_id", "str", _text, None, "the host name, the kernel's boot id and the device of /dev/shm",
            "which node this process runs on, for `peer_copies` (a launcher that knows better sets it); see "
            f"{_NODE_LOSS}", env="MPCKPT_NODE_ID", keyword=False, in_config=False),
    Setting("direct_io", "bool", _bool, DEFAULT_DIRECT_IO, "on", "local files are written with `O_DIRECT` "
            "(bypassing the page cache) where the filesystem allows it", env="MPCKPT_DIRECT_IO", keyword=False),
    Setting("progress", "bool", _bool, DEFAULT_PROGRESS, "on", "a progress bar for a load or restore lasting "
            "more than a second, only when stderr is a terminal, rank 0 only", env="MPCKPT_PROGRESS",
            keyword=False, in_config=False),
)
SETTING = {s.name: s for s in SETTINGS}


def progress_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether loading may show a progress bar: ``MPCKPT_PROGRESS`` (default on).

    The caller still shows none when stderr is not a terminal.
    """
    return bool(SETTING["progress"].value(None, os.environ if environ is None else environ))


@dataclass(frozen=True)
class Config:
    """Everything a Checkpointer needs to know, validated (``resolve``: the declared ``SETTINGS``)."""

    memory_budget_bytes: int
    workers: int
    policy: BudgetPolicy
    overlap: bool
    allow_pickle: bool
    keep_last: int | None
    timeout_s: float
    start_method: str
    uploader_priority: UploaderPriority
    job_timeout_s: float
    direct_io: bool  # asked for; the local backend also needs os.O_DIRECT
    keep: RetentionPolicy | None
    trigger: Trigger | None
    validate: Any  # fn(Checkpoint) -> {name: number}, run in the validator process after each commit
    validate_timeout_s: float
    keep_in_memory: bool
    peer_copies: int  # copies of each rank's kept snapshot in other nodes' memory
    preemption: bool | Sequence[int | str]  # parsed into signals when the root opens
    process_group: Any  # None: the default group if torch.distributed is initialized; False: none
    max_job_attempts: int = DEFAULT_MAX_JOB_ATTEMPTS
    nice: int = DEFAULT_NICE  # the validator process's

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
    def resolve(cls, *, environ: Mapping[str, str] | None = None, **given: Any) -> Config:
        """Each declared setting from ``given`` (by name; None: not given), else its ``MPCKPT_*``
        variable in ``environ`` (default: ``os.environ``), else its default."""
        env = os.environ if environ is None else environ
        unknown = sorted(set(given) - {s.name for s in SETTINGS if s.in_config})
        if unknown:
            raise ConfigError(f"unknown setting {', '.join(unknown)}; the settings are "
                              f"{', '.join(s.name for s in SETTINGS if s.keyword)} (docs/guide/settings.md)")
        values = {s.stored_as or s.name: s.value(given.get(s.name), env) for s in SETTINGS if s.in_config}
        if values["peer_copies"] and not values["keep_in_memory"]:
            raise ConfigError(f"peer_copies={values['peer_copies']} copies the snapshot kept in memory to other "
                              "nodes, but keep_in_memory is off; turn keep_in_memory on (MPCKPT_KEEP_IN_MEMORY=1) "
                              "or set peer_copies to 0")
        return cls(**values)


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
