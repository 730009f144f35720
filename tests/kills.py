"""What the tests that kill a rank of a job share: the step a job goes back to after a kill at
a moment of a step, the snapshots a test's roots left in /dev/shm, and the uninterrupted run of
the same job that a killed one is compared with (made once per world size and model)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from mpckpt._keep import store


def expected_step(moment: str, completed_by_killed: bool, kill_step: int) -> int:
    """The newest step every rank completed when a rank died at ``moment`` of ``kill_step``
    (``completed_by_killed``: it saved that step)."""
    if moment in ("forward", "before_optim"):
        return kill_step - 1
    if moment == "in_save":
        return kill_step if completed_by_killed else kill_step - 1
    return kill_step


def remove_kept_under(folder: Path) -> None:
    """The snapshots kept in /dev/shm for roots under ``folder`` (no one else's)."""
    for kept in store.list_kept():
        if kept.root is not None and kept.root.startswith(str(folder)) and not kept.held:
            store.remove_kept(kept.base)


def uninterrupted_jobs(tmp_path_factory: pytest.TempPathFactory,
                       run_job: Callable[[Path, int, str], Any]) -> Iterator[Callable[[int, str], Any]]:
    """For a module fixture: ``(world, model) -> job``, ``run_job`` without a kill, once per world
    size and model; their kept snapshots removed at the end."""
    jobs: dict[tuple[int, str], Any] = {}
    folders: list[Path] = []

    def get(world: int, model: str) -> Any:
        if (world, model) not in jobs:
            folders.append(tmp_path_factory.mktemp(f"uninterrupted-{model}{world}"))
            jobs[world, model] = run_job(folders[-1], world, model)
        return jobs[world, model]

    yield get
    for folder in folders:
        remove_kept_under(folder)
