"""Retention policies as pure functions over committed checkpoints.

A policy takes the committed checkpoints, oldest first, as ``(step, manifest)`` pairs and
returns one keep/delete decision per entry. Policies never look at the clock or storage
themselves (``now`` is passed in), so they are tested without either, and they combine:
``keep_any`` keeps what any policy keeps. The newest checkpoint is always kept, and the
checkpointer never deletes a folder that a newer manifest still references.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from mpckpt.errors import ConfigError

Records = Sequence[tuple[int, Any]]
Policy = Callable[[Records], list[bool]]


def _with_newest(keep: list[bool]) -> list[bool]:
    if keep:
        keep[-1] = True
    return keep


def keep_last_n(records: Records, n: int) -> list[bool]:
    """Keep the ``n`` newest."""
    if n < 1:
        raise ConfigError(f"keep_last={n} must be at least 1")
    return _with_newest([i >= len(records) - n for i in range(len(records))])


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


def keep_best_n(records: Records, n: int, metric: str, mode: str = "min") -> list[bool]:
    """Keep the ``n`` with the best ``metric`` (checkpoints without it are not kept by this rule)."""
    best = set(rank_by_metric(records, metric, mode)[:n])
    return _with_newest([i in best for i in range(len(records))])


def keep_every_n_steps(records: Records, n: int) -> list[bool]:
    """Keep checkpoints whose step is a multiple of ``n`` (long-term milestones)."""
    return _with_newest([step % n == 0 for step, _ in records])


def keep_newer_than(records: Records, seconds: float, now: float) -> list[bool]:
    """Keep checkpoints created within ``seconds`` before ``now``."""
    return _with_newest([now - m.created_unix <= seconds for _, m in records])


def keep_any(records: Records, *policies: Policy) -> list[bool]:
    """Keep what any of ``policies`` keeps."""
    votes = [p(records) for p in policies]
    return _with_newest([any(v[i] for v in votes) for i in range(len(records))])
