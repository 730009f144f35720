"""Retention policies: objects that decide which committed checkpoints to keep.

A policy looks at the committed checkpoints, oldest first, as ``(step, manifest)`` pairs and
returns one keep/delete decision per entry (``keep``). Policies never look at storage
themselves, and the clock only through a function they are given, so they are tested
without either. They combine with ``|``: ``KeepLast(3) | KeepBest(2, "val_loss")`` keeps
what either keeps. The newest checkpoint is always kept.

Policies only decide. The committer applies the decision after each commit and never deletes
a folder that a committed or pending checkpoint still references; the ``Deleter`` deletes.
"""

from __future__ import annotations

import abc
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from mpckpt.errors import ConfigError

Records = Sequence[tuple[int, Any]]


class RetentionPolicy(abc.ABC):
    """Which committed checkpoints to keep; subclasses implement ``votes``."""

    def keep(self, records: Records) -> list[bool]:
        """One decision per record, oldest first; the newest is always kept."""
        decisions = list(self.votes(records))
        if len(decisions) != len(records):
            raise AssertionError(f"{self!r} decided {len(decisions)} of {len(records)} checkpoints")
        if decisions:
            decisions[-1] = True
        return decisions

    @abc.abstractmethod
    def votes(self, records: Records) -> list[bool]:
        """This policy's own decision per record (``keep`` adds: the newest is always kept)."""

    def __or__(self, other: RetentionPolicy) -> RetentionPolicy:
        if not isinstance(other, RetentionPolicy):
            return NotImplemented
        return KeepAny(self, other)


class KeepAny(RetentionPolicy):
    """Keep what any of ``policies`` keeps (what ``a | b`` builds)."""

    policies: tuple[RetentionPolicy, ...]

    def __init__(self, *policies: RetentionPolicy) -> None:
        flat: list[RetentionPolicy] = []
        for policy in policies:
            flat.extend(policy.policies if isinstance(policy, KeepAny) else [policy])
        self.policies = tuple(flat)

    def votes(self, records: Records) -> list[bool]:
        each = [p.votes(records) for p in self.policies]
        return [any(v[i] for v in each) for i in range(len(records))]

    def __repr__(self) -> str:
        return " | ".join(repr(p) for p in self.policies)


class KeepLast(RetentionPolicy):
    """Keep the ``n`` newest."""

    def __init__(self, n: int) -> None:
        self.n = _positive(n, "KeepLast(n)")

    def votes(self, records: Records) -> list[bool]:
        return [i >= len(records) - self.n for i in range(len(records))]

    def __repr__(self) -> str:
        return f"KeepLast({self.n})"


class KeepBest(RetentionPolicy):
    """Keep the ``n`` with the best ``metric``.

    Checkpoints without the metric (or with NaN: a diverged step) are not ranked. By default
    this rule does not keep them; ``keep_missing=True`` keeps them, for metrics that arrive
    after the commit (``validate=``) or are reported only now and then.
    """

    def __init__(self, n: int, metric: str, mode: str = "min", *, keep_missing: bool = False) -> None:
        self.n = _positive(n, "KeepBest(n)")
        if mode not in ("min", "max"):
            raise ConfigError(f"KeepBest(mode={mode!r}): use 'min' or 'max'")
        if not isinstance(keep_missing, bool):
            raise ConfigError(f"KeepBest(keep_missing={keep_missing!r}) must be True or False")
        self.metric, self.mode, self.keep_missing = metric, mode, keep_missing

    def votes(self, records: Records) -> list[bool]:
        ranked = rank_by_metric(records, self.metric, self.mode)
        best = set(ranked[:self.n])
        if self.keep_missing:
            scored = set(ranked)
            return [i in best or i not in scored for i in range(len(records))]
        return [i in best for i in range(len(records))]

    def __repr__(self) -> str:
        extra = ", keep_missing=True" if self.keep_missing else ""
        return f"KeepBest({self.n}, {self.metric!r}, {self.mode!r}{extra})"


class KeepEvery(RetentionPolicy):
    """Keep checkpoints whose step is a multiple of ``n`` (long-term milestones)."""

    def __init__(self, n: int) -> None:
        self.n = _positive(n, "KeepEvery(n)")

    def votes(self, records: Records) -> list[bool]:
        return [step % self.n == 0 for step, _ in records]

    def __repr__(self) -> str:
        return f"KeepEvery({self.n})"


class KeepInterval(RetentionPolicy):
    """Keep one checkpoint per ``seconds`` of wall time: thin out an old history evenly.

    Oldest first, a checkpoint is kept when it was committed at least ``seconds`` after the
    last one this rule kept (the oldest is kept). The decision is stable: applied again after
    the others were deleted, it keeps the same checkpoints.
    """

    def __init__(self, seconds: float) -> None:
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0 \
                or not math.isfinite(seconds):
            raise ConfigError(f"KeepInterval({seconds!r}) needs a positive, finite number of seconds")
        self.seconds = float(seconds)

    def votes(self, records: Records) -> list[bool]:
        out, last = [], -math.inf
        for _, m in records:
            kept = m.created_unix - last >= self.seconds
            if kept:
                last = m.created_unix
            out.append(kept)
        return out

    def __repr__(self) -> str:
        return f"KeepInterval({self.seconds:g})"


class KeepNewerThan(RetentionPolicy):
    """Keep checkpoints created within ``seconds`` before now (``clock``: unix time)."""

    def __init__(self, seconds: float, *, clock: Callable[[], float] = time.time) -> None:
        if not seconds > 0:
            raise ConfigError(f"KeepNewerThan({seconds!r}) needs a positive number of seconds")
        self.seconds, self.clock = float(seconds), clock

    def votes(self, records: Records) -> list[bool]:
        now = self.clock()
        return [now - m.created_unix <= self.seconds for _, m in records]

    def __repr__(self) -> str:
        return f"KeepNewerThan({self.seconds:g})"


def rank_by_metric(records: Records, metric: str, mode: str = "min") -> list[int]:
    """Indices of ``records`` that have a numeric ``metric``, best first (``mode`` 'min' or 'max').

    Checkpoints without the metric, or with a NaN (a diverged step), are not ranked: a NaN
    compares false with everything and would put the wrong step first.
    """
    if mode not in ("min", "max"):
        raise ConfigError(f"mode={mode!r}: use 'min' or 'max'")
    scored = []
    for i, (_, m) in enumerate(records):
        value = m.metrics.get(metric)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value):
            scored.append((value, i))
    scored.sort(key=lambda x: x[0], reverse=(mode == "max"))
    return [i for _, i in scored]


def _positive(n: Any, what: str) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"{what}={n!r} must be a whole number of at least 1")
    return n
