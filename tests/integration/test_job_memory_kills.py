"""A rank of a torchrun job SIGKILLed at each moment of a step: the restarted job resumes from memory.

Each case runs ``job_kill_worker.py`` under ``torchrun --standalone --max-restarts 1`` (gloo on CPU):
a small model under DDP (one case FSDP2) with AdamW and a ``PerRank`` blob of ``BLOB_MB`` MiB per
rank trains ``STEPS`` deterministic steps, saving each with ``mode="memory"`` and every
``STORAGE_EVERY``-th to storage. On the first attempt one rank SIGKILLs itself at step ``KILL_STEP``:

- ``forward``       mid-forward: every rank completed S - 1;
- ``before_optim``  after S's backward, once every other rank saved S: they hold S, it holds S - 1;
- ``in_save``       inside ``save(S)``, mid-copy into shared memory, once every other rank saved S;
- ``after_save``    right after its ``save(S)`` returned, once every other rank saved S.

torchrun then stops the others and relaunches the job once. What must hold, at 2 and 3 ranks:

- the job exits 0;
- on the second attempt every rank restored the same step R, from ``"memory"`` (not storage,
  whose newest step is ``STORAGE_EVERY``): R is the newest step every rank had completed when the
  rank died (the lowest of the ranks' last ``saved`` lines), which is S - 1 for ``forward`` and
  ``before_optim``, S - 1 for ``in_save`` (S had the killed rank finished it), S for ``after_save``;
- every rank's restored state is, bit for bit, the state it saved at R on the first attempt;
- every rank's final state is, bit for bit, that of an uninterrupted run of the same job.

The blob stands in its states by its xxh3-128 (``job_kill_worker.local_state``).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import kills
from tests.conftest import assert_same
from tests.kills import remove_kept_under, uninterrupted_jobs
from tests.launch import finish, start, tail, worker_env

WORKER = str(Path(__file__).with_name("job_kill_worker.py"))
STEPS, KILL_STEP, STORAGE_EVERY = 10, 7, 5
BLOB_MB = 32  # per rank: a save's copy takes long enough to be caught in the middle
BUDGET = "160MiB"  # about four slabs of a rank's state (the blob and its share of the model)
JOB_TIMEOUT_S = 240


@dataclass
class Job:
    """One torchrun job's output folder (``OUT/rank<r>/...``, see ``job_kill_worker``)."""

    out: Path
    world: int
    log: Path

    def rank_dir(self, rank: int) -> Path:
        return self.out / f"rank{rank}"

    def restored(self, rank: int, attempt: int) -> dict[str, Any]:
        path = self.rank_dir(rank) / f"restored-{attempt}.json"
        assert path.exists(), f"rank {rank} wrote no {path.name}; the job's log ends:\n{tail(self.log)}"
        return json.loads(path.read_text())

    def saved(self, rank: int) -> list[int]:
        """The steps rank ``rank`` saved on the first attempt (``save`` returned), in order."""
        lines = (self.rank_dir(rank) / "trace").read_text().split("\n")
        return [int(line.split()[1]) for line in lines if line.startswith("saved ")]

    def state(self, rank: int, name: str) -> dict[str, Any]:
        return torch.load(self.rank_dir(rank) / f"{name}.pt")

    def killed(self) -> tuple[int, dict[str, Any]]:
        found = [(r, json.loads(p.read_text())) for r in range(self.world)
                 if (p := self.rank_dir(r) / "kill.json").exists()]
        assert len(found) == 1, f"expected one rank to have killed itself, found {found}; log:\n{tail(self.log)}"
        return found[0]


def run_job(tmp: Path, world: int, model: str, *options: Any) -> Job:
    """``job_kill_worker.py`` on ``world`` ranks under torchrun with one restart; it must exit 0."""
    out, log = tmp / "out", tmp / "log.txt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           "--max-restarts=1", WORKER, str(tmp / "root"), str(out), "--model", model, "--steps", str(STEPS),
           "--storage-every", str(STORAGE_EVERY), "--blob-mb", str(BLOB_MB), "--budget", BUDGET,
           *map(str, options)]
    code = finish(start(cmd, log, worker_env()), log, JOB_TIMEOUT_S)
    assert code == 0, f"torchrun exited with {code}; its log ends:\n{tail(log)}"
    return Job(out, world, log)


@pytest.fixture(autouse=True)
def _no_kept_left(tmp_path: Path) -> Any:
    yield
    remove_kept_under(tmp_path)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``(world, model) -> Job``: the same job without a kill, once per world size and model."""
    yield from uninterrupted_jobs(tmp_path_factory, run_job)


def expected_step(moment: str, completed_by_killed: bool) -> int:
    return kills.expected_step(moment, completed_by_killed, KILL_STEP)



CASES = [pytest.param(moment, world, "ddp", id=f"{moment}-ddp{world}")
         for moment in ("forward", "before_optim", "in_save", "after_save") for world in (2, 3)]
CASES.append(pytest.param("before_optim", 2, "fsdp", id="before_optim-fsdp2"))


@pytest.mark.parametrize(("moment", "world", "model"), CASES)
def test_a_rank_killed_mid_step_restarts_the_job_from_memory_at_the_newest_step_every_rank_completed(
        tmp_path, uninterrupted, moment, world, model):
    kill_rank = 1 if world == 2 else 0  # at 3 ranks the one that dies is rank 0
    job = run_job(tmp_path, world, model, "--moment", moment, "--kill-rank", kill_rank, "--kill-step", KILL_STEP)

    # the kill happened as the case means it to
    rank, kill = job.killed()
    assert (rank, kill["moment"], kill["step"]) == (kill_rank, moment, KILL_STEP), kill
    saved = {r: job.saved(r) for r in range(world)}
    others = [r for r in range(world) if r != kill_rank]
    if moment != "forward":
        assert kill["others_saved"] and all(saved[r][-1] >= KILL_STEP for r in others), (kill, saved)
    if moment == "in_save":
        assert kill["mid_copy"], f"the watcher saw no thread copying within its bound: {kill}"
    newest = min(s[-1] for s in saved.values())  # the newest step every rank completed
    assert newest == expected_step(moment, KILL_STEP in saved[kill_rank]), saved
    assert [job.restored(r, 0)["step"] for r in range(world)] == [None] * world, "the first attempt started fresh"

    # the second attempt restored that step from memory on every rank, bit for bit
    got = [(d["step"], d["source"]) for d in (job.restored(r, 1) for r in range(world))]
    assert got == [(newest, "memory")] * world, (
        f"attempt 1 restored (step, source) {got} on ranks 0..{world - 1}; expected step {newest} from memory on "
        f"every rank (rank {kill_rank} killed {moment} of step {KILL_STEP}; steps saved on attempt 0: "
        f"{ {r: s[-2:] for r, s in saved.items()} }; storage's newest is {STORAGE_EVERY})")
    for r in range(world):
        assert_same(job.state(r, "restored-1"), job.state(r, f"state-{newest}"), f"rank {r} restored")

    # and trained on to the state of an uninterrupted run
    plain = uninterrupted(world, model)
    for r in range(world):
        assert_same(job.state(r, "final"), plain.state(r, "final"), f"rank {r} final")
