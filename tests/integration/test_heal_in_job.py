"""A rank of a job under ``python -m mpckpt.run`` SIGKILLed: a replacement joins, the others heal in place.

Each case runs ``heal_worker.py`` under ``python -m mpckpt.run --standalone`` (gloo on CPU): a small
model under DDP or FSDP2 with AdamW and a ``PerRank`` blob, ``STEPS`` deterministic steps, each saved
with ``mode="memory"`` and every ``STORAGE_EVERY``-th to storage. In generation 0 one rank SIGKILLs
itself at step ``KILL_STEP`` at one moment (``job_kill_worker``'s: mid-forward, between backward and
its optimizer step, mid-copy of its save, right after its save). What must hold:

- the launcher exits 0, having started one replacement (two with ``--second``, whose first
  replacement dies while the survivors heal);
- every surviving rank is the process it was (one process of that rank, the same pid at the end),
  healed once, in place, at the newest step every rank had completed (the lowest of the ranks'
  last ``saved`` lines), from ``"memory"``, bit for bit the state it saved at that step;
- the replacement restored the same step from ``"memory"`` (its dead predecessor's kept snapshot),
  bit for bit what its predecessor saved;
- every rank's final state is, bit for bit, that of an uninterrupted run of the same job;
- nothing is left: no process of the job's session, no kept snapshot of its root, no shared-memory
  segment of its processes.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import mpckpt
from mpckpt._keep import store
from mpckpt._system import shm
from tests import kills
from tests.conftest import assert_same
from tests.kills import remove_kept_under, uninterrupted_jobs
from tests.launch import finish, start, tail, worker_env

WORKER = str(Path(__file__).with_name("heal_worker.py"))
STEPS, KILL_STEP, STORAGE_EVERY = 10, 7, 5
BLOB_MB = 16
JOB_TIMEOUT_S = 240


@dataclass
class Job:
    """One ``mpckpt.run`` job's output folder (``OUT/rank<r>/...``, see ``heal_worker``)."""

    out: Path
    world: int
    log: Path
    session: int  # the launcher's pid: the session of every process of the job

    def rank_dir(self, rank: int) -> Path:
        return self.out / f"rank{rank}"

    def processes(self, rank: int) -> list[dict[str, Any]]:
        """Every process that ran ``rank``, in the order they started (by generation)."""
        found = [json.loads(p.read_text()) for p in self.rank_dir(rank).glob("proc-*.json")]
        return sorted(found, key=lambda d: d["generation"])

    def final(self, rank: int) -> dict[str, Any]:
        path = self.rank_dir(rank) / "final.json"
        assert path.exists(), f"rank {rank} did not finish; the job's log ends:\n{tail(self.log)}"
        return json.loads(path.read_text())

    def saved_before_heal(self, rank: int) -> list[int]:
        """The steps rank ``rank``'s process of generation 0 saved before it healed (or died)."""
        saved = []
        for line in (self.rank_dir(rank) / "trace").read_text().split("\n"):
            if line.startswith("healed "):
                break
            if line.startswith("saved "):
                saved.append(int(line.split()[1]))
        return saved

    def state(self, rank: int, name: str) -> dict[str, Any]:
        return torch.load(self.rank_dir(rank) / f"{name}.pt")

    def killed(self) -> list[tuple[int, dict[str, Any]]]:
        return sorted((r, json.loads(p.read_text())) for r in range(self.world)
                      for p in [self.rank_dir(r) / "kill.json"] if p.exists())


def run_job(tmp: Path, world: int, model: str, *options: Any, restarts: int = 2, ok: bool = True) -> Job:
    """``heal_worker.py`` on ``world`` ranks under ``python -m mpckpt.run``; with ``ok`` it must exit 0. Without a
    warm spare (``--spares 0``: replacements start cold, and no spare's imports take the two cores from the
    job) unless the case waits for one (``--wait-for-spare``)."""
    out, log = tmp / "out", tmp / "log.txt"
    spares = 1 if "--wait-for-spare" in options else 0
    cmd = [sys.executable, "-m", "mpckpt.run", "--standalone", f"--nproc-per-node={world}",
           f"--max-restarts={restarts}", f"--spares={spares}", WORKER, str(tmp / "root"), str(out), "--model", model, "--steps", str(STEPS),
           "--storage-every", str(STORAGE_EVERY), "--blob-mb", str(BLOB_MB), *map(str, options)]
    proc = start(cmd, log, worker_env())
    code = finish(proc, log, JOB_TIMEOUT_S)
    if ok:
        assert code == 0, f"mpckpt.run exited with {code}; its log ends:\n{tail(log)}"
    return Job(out, world, log, proc.pid)


def session_members(session: int) -> list[int]:
    """The processes still alive in ``session`` (zombies excluded)."""
    alive = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[3]) == session and fields[0] != "Z":
            alive.append(int(entry))
    return alive


def assert_nothing_left(job: Job, root: Path, *, kept_left: bool = False) -> None:
    """No process of the job's session alive; unless ``kept_left``, no kept snapshot of ``root`` nor
    shared-memory segment of the job's processes (a job stopped by signal leaves them, as a crash)."""
    deadline = time.monotonic() + 15
    while (left := session_members(job.session)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes of the job still alive after the launcher ended: {left}"
    if kept_left:
        return
    kept = [k.base for k in store.list_kept() if k.root is not None and k.root.startswith(str(root))]
    assert not kept, f"kept snapshots of {root} left in /dev/shm: {kept}"
    pids = {p["pid"] for r in range(job.world) for p in job.processes(r)}
    segments = [s for s in shm.list_segments() if any(s.startswith(f"mpckpt-{pid}-") for pid in pids)]
    assert not segments, f"shared-memory segments of the job's processes left: {segments}"


@pytest.fixture(autouse=True)
def _no_kept_left(tmp_path: Path) -> Any:
    yield
    remove_kept_under(tmp_path)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``(world, model) -> Job``: the same job without a kill, once per world size and model."""
    yield from uninterrupted_jobs(tmp_path_factory, run_job)


def check_healed(job: Job, kill_rank: int, moment: str, *, replacements: int, kill_step: int = KILL_STEP) -> int:
    """What every case asserts of the ranks (see the module docstring); the step healed at."""
    world = job.world
    killed = job.killed()
    assert [(r, k["moment"], k["step"]) for r, k in killed][:1] == [(kill_rank, moment, kill_step)], killed
    saved = {r: job.saved_before_heal(r) for r in range(world)}
    newest = min(s[-1] for s in saved.values())
    assert newest == kills.expected_step(moment, kill_step in saved[kill_rank], kill_step), saved
    for r in range(world):
        procs = job.processes(r)
        final = job.final(r)
        if r != kill_rank:  # a survivor: one process, the same from start to end, healed in place
            assert len(procs) == 1 and procs[0]["generation"] == 0, (r, procs)
            assert final["pid"] == procs[0]["pid"], (r, final, procs)
            heals = procs[0]["heals"]
            assert heals and [(h["step"], h["source"]) for h in heals[-1:]] == [(newest, "memory")], (r, heals)
            assert_same(job.state(r, f"healed-{final['pid']}"), job.state(r, f"state-{newest}"), f"rank {r} healed")
        else:  # the dead process and its replacement(s)
            assert len(procs) == 1 + replacements, (r, procs)
            assert final["generation"] == replacements and final["pid"] == procs[-1]["pid"], (r, final, procs)
            assert (procs[-1]["restored"], procs[-1]["source"]) == (newest, "memory"), procs[-1]
            assert_same(job.state(r, f"restored-{final['pid']}"), job.state(r, f"state-{newest}"),
                        f"rank {r}'s replacement restored")
    return newest


CASES = [pytest.param(moment, 2, "ddp", (), id=f"{moment}-ddp2") for moment in ("forward", "in_save", "after_save")]
CASES += [pytest.param("before_optim", 2, "ddp", ("--wait-for-spare",), id="before_optim-ddp2-spare"),
          pytest.param("before_optim", 4, "ddp", (), id="before_optim-ddp4"),
          pytest.param("before_optim", 2, "fsdp", (), id="before_optim-fsdp2")]
# (FSDP2 at 4 ranks heals as at 2: rebuilt and sharded on the new mesh; its case was the suite's slowest)


@pytest.mark.parametrize(("moment", "world", "model", "options"), CASES)
def test_a_killed_rank_is_replaced_and_the_survivors_heal_in_place_bit_exact(tmp_path, uninterrupted, moment, world,
                                                                            model, options):
    """(``-spare``: the kill waits for the launcher's warm spare, which becomes the replacement.)"""
    kill_rank = 1 if world == 2 else 0  # at 4 ranks rank 0 dies: the one that holds the root's lock
    job = run_job(tmp_path, world, model, "--moment", moment, "--kill-rank", kill_rank, "--kill-step", KILL_STEP,
                  *options)
    check_healed(job, kill_rank, moment, replacements=1)
    if "--wait-for-spare" in options:
        spare = json.loads((job.rank_dir(kill_rank) / "spare.json").read_text())["pid"]
        assert job.processes(kill_rank)[-1]["pid"] == spare, (spare, job.processes(kill_rank))
    plain = uninterrupted(world, model)
    for r in range(world):
        assert_same(job.state(r, "final"), plain.state(r, "final"), f"rank {r} final")
    assert_nothing_left(job, tmp_path / "root")


def test_a_rank_killed_in_a_save_to_storage_heals_and_the_step_is_saved_again(tmp_path, uninterrupted):
    """Rank 1 SIGKILLed inside its save of a storage step (``STORAGE_EVERY``), the survivor's upload of
    it in flight (not waited for): the failed group never commits that step; after the heal it is saved
    again and committed, and storage holds exactly the steps of an uninterrupted run, every one
    readable (its checksums verified)."""
    kill_step = STORAGE_EVERY
    job = run_job(tmp_path, 2, "ddp", "--moment", "in_save", "--kill-rank", 1, "--kill-step", kill_step,
                  "--storage-no-wait")
    check_healed(job, 1, "in_save", replacements=1, kill_step=kill_step)
    plain = uninterrupted(2, "ddp")
    for r in range(2):
        assert_same(job.state(r, "final"), plain.state(r, "final"), f"rank {r} final")
    with mpckpt.Checkpointer(tmp_path / "root", read_only=True) as ckpt:
        assert ckpt.steps() == list(range(0, STEPS, STORAGE_EVERY)), ckpt.steps()
        for step in ckpt.steps():
            assert ckpt.load(step) is not None
    assert_nothing_left(job, tmp_path / "root")


def test_a_second_failure_during_the_heal_heals_again(tmp_path, uninterrupted):
    """The replacement dies once it formed the group, before its restore: the survivors, healing, heal
    again in the next generation with a second replacement."""
    job = run_job(tmp_path, 2, "ddp", "--moment", "before_optim", "--kill-rank", 1, "--kill-step", KILL_STEP,
                  "--second")
    assert (job.rank_dir(1) / "kill-second.json").exists(), tail(job.log)
    check_healed(job, 1, "before_optim", replacements=2)
    plain = uninterrupted(2, "ddp")
    for r in range(2):
        assert_same(job.state(r, "final"), plain.state(r, "final"), f"rank {r} final")
    assert_nothing_left(job, tmp_path / "root")


def test_a_survivor_lost_while_the_group_forms_again_moves_everyone_to_the_next_generation(tmp_path, uninterrupted):
    """4 ranks: rank 1 SIGKILLed before its optimizer step; rank 2, a survivor, dies too once ranks 0
    and 3 gathered to form generation 1's group. Nobody waits in generation 1's rendezvous for the
    group's timeout: ranks 0 and 3 (and rank 1's first replacement, if it started in time) move to
    generation 2, where a replacement of rank 2 joins; ranks 0 and 3 are the processes they were,
    the replacements restore their predecessors' kept snapshots, and the job ends as uninterrupted."""
    job = run_job(tmp_path, 4, "ddp", "--moment", "before_optim", "--kill-rank", 1, "--kill-step", KILL_STEP,
                  "--die-healing", 2)
    died = json.loads((job.rank_dir(2) / "die-healing.json").read_text())
    assert died["gathered"] >= 2, died
    newest = KILL_STEP - 1
    assert min(job.saved_before_heal(r)[-1] for r in range(4)) == newest
    for r in (0, 3):
        procs, final = job.processes(r), job.final(r)
        assert len(procs) == 1 and final["pid"] == procs[0]["pid"], (r, procs, final)
        heal = procs[0]["heals"][-1]
        assert (heal["generation"], heal["step"], heal["source"]) == (2, newest, "memory"), (r, procs[0]["heals"])
        assert sorted(heal["lost"]) == [1, 2], heal
        assert_same(job.state(r, f"healed-{final['pid']}"), job.state(r, f"state-{newest}"), f"rank {r} healed")
    for r in (1, 2):
        procs, final = job.processes(r), job.final(r)
        assert final["pid"] == procs[-1]["pid"] and final["pid"] != procs[0]["pid"], (r, procs, final)
        assert (procs[-1]["restored"], procs[-1]["source"]) == (newest, "memory"), procs[-1]
        assert_same(job.state(r, f"restored-{final['pid']}"), job.state(r, f"state-{newest}"), f"rank {r} restored")
    plain = uninterrupted(4, "ddp")
    for r in range(4):
        assert_same(job.state(r, "final"), plain.state(r, "final"), f"rank {r} final")
    assert_nothing_left(job, tmp_path / "root")


def test_the_example_heals_in_place_as_its_docstring_says(tmp_path):
    """``examples/heal_in_place.py``, started as documented: rank 1 dies mid-step, rank 0's process
    heals in place, the replacement restores from memory, and the final model is the uninterrupted
    run's bit for bit (the example checks that and exits 1 if not)."""
    log = tmp_path / "log.txt"
    cmd = [sys.executable, "-m", "mpckpt.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "2",
           "examples/heal_in_place.py", "--root", str(tmp_path / "root"), "--steps", "16", "--kill-at", "7",
           "--storage-every", "5"]
    code = finish(start(cmd, log, worker_env()), log, JOB_TIMEOUT_S)
    text = log.read_text(errors="replace")
    assert code == 0, tail(log)
    assert "[rank 1 pid" in text and "dying in step 7" in text, tail(log)
    assert "] healed in place in " in text and "rank(s) [1] lost, back to step 6 from memory" in text, tail(log)
    assert "restored step 6 from memory" in text, tail(log)
    assert "[rank 0] the final model is bit for bit the uninterrupted run's" in text, tail(log)


def test_more_failures_than_max_restarts_stop_the_job_saying_so(tmp_path):
    job = run_job(tmp_path, 2, "ddp", "--moment", "before_optim", "--kill-rank", 1, "--kill-step", 3,
                  restarts=0, ok=False)
    text = job.log.read_text(errors="replace")
    assert "more than --max-restarts=0" in text, tail(job.log)
    assert_nothing_left(job, tmp_path / "root", kept_left=True)
