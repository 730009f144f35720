"""The keyword groups of ``Checkpointer``: settings grouped the way a user thinks of them.

``Checkpointer(root, memory=Memory(...), uploads=Uploads(...), retention=Retention(...),
job=Job(...))``: each group is a small frozen dataclass whose fields are settings declared in
``config.SETTINGS`` (each field there names its ``group`` and ``field``; a unit test keeps the
two in step, types included). Every grouped setting is also a flat keyword of its own
(``memory_budget=`` for ``Memory(budget=)``), the shorthand of the common one-line use.

``gather`` routes both into one mapping of setting names that ``Config.resolve`` takes: a group
of the wrong type, or a flat keyword and its group field given different values, is a
``ConfigError`` naming both. A field left at None is not given (the variable or the default
then decides).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from mpckpt.config import SETTINGS, BudgetPolicy, UploaderPriority
from mpckpt.errors import ConfigError
from mpckpt.policies.retention import RetentionPolicy
from mpckpt.policies.triggers import Trigger


@dataclass(frozen=True, kw_only=True)
class Memory:
    """Shared memory for snapshots: how much, what a full budget does, copying, keeping the newest."""

    budget: int | str | float | None = None    # memory_budget: '8GiB', bytes, or a fraction such as 0.5
    policy: str | BudgetPolicy | None = None   # 'block', 'skip' or 'coalesce'
    overlap: bool | None = None
    keep: bool | None = None                   # keep_in_memory: the newest snapshot stays, for a restart


@dataclass(frozen=True, kw_only=True)
class Uploads:
    """The uploader processes: how many, their CPU share, how they start, one file's deadline."""

    workers: int | None = None
    priority: str | UploaderPriority | None = None   # uploader_priority: 'idle', 'low' or 'normal'
    start_method: str | None = None
    timeout_s: float | None = None                   # job_timeout_s: one file's upload (plus a second per MB)


@dataclass(frozen=True, kw_only=True)
class Retention:
    """Which steps are saved (``trigger``) and which committed checkpoints are kept."""

    keep_last: int | None = None
    keep: RetentionPolicy | None = None
    trigger: Trigger | None = None


@dataclass(frozen=True, kw_only=True)
class Job:
    """Saving from several ranks: the process group, and copies in other nodes' memory."""

    process_group: Any = None
    peer_copies: int | None = None


GROUPS: dict[str, type] = {"memory": Memory, "uploads": Uploads, "retention": Retention, "job": Job}


def gather(flat: Mapping[str, Any], groups: Mapping[str, Any]) -> dict[str, Any]:
    """The settings given as flat keywords (``flat``, by setting name) and in ``groups`` (by the
    keyword of the group: ``{"memory": Memory(...)}``), by setting name; None: not given."""
    given = dict(flat)
    for keyword, group in groups.items():
        if group is None:
            continue
        kind = GROUPS[keyword]
        if not isinstance(group, kind):
            names = ", ".join(f"{f.name}=..." for f in fields(kind))
            raise ConfigError(f"{keyword}={group!r} is not an mpckpt.{kind.__name__}; give "
                              f"{keyword}=mpckpt.{kind.__name__}({names})")
        for setting in SETTINGS:
            if setting.group != keyword or setting.field is None:
                continue
            value = getattr(group, setting.field)
            if value is None:
                continue
            mine = given.get(setting.name)
            if mine is not None and mine is not value and mine != value:
                raise ConfigError(f"{setting.name}={mine!r} and {keyword}=mpckpt.{kind.__name__}("
                                  f"{setting.field}={value!r}) are one setting given twice, with different "
                                  f"values; give it once")
            given[setting.name] = value
    return given


def given_settings(options: Mapping[str, Any]) -> dict[str, Any]:
    """The settings a mapping of ``Checkpointer`` keywords gives (groups spread into setting names;
    None left out): what an integration that passes ``**options`` through checks them by."""
    groups = {k: v for k, v in options.items() if k in GROUPS}
    flat = {k: v for k, v in options.items() if k not in GROUPS}
    return {k: v for k, v in gather(flat, groups).items() if v is not None}
