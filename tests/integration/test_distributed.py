"""Multi-rank checkpoints with real processes: torchrun (or plain processes), gloo on CPU, real files.

Every job runs ``dist_worker.py`` (one scenario per launch), which writes what its ranks saw into a
folder the test reads: the full tensors rank 0 gathered (``DTensor.full_tensor()``), every rank's
``latest_step``, its draws from the restored generators, the errors it got.

- FSDP2 + AdamW at 2 ranks, and at 3 ranks with ``overlap=True``: ``mpckpt.load`` of every step
  equals, bit for bit, the full model and optimizer tensors; every rank says the same
  ``latest_step``; each rank's PerRank RNG state is stored.
- DDP at 2 ranks: the consolidated load equals the model; every replicated tensor is stored by
  exactly one rank, and both ranks store some (the write load is spread).
- Resharding 2 -> 3, 3 -> 2, 2 -> 1 into a model with other weights and an optimizer with no state:
  model and moments come back bit for bit, ``restore(strict=True)`` is a StateError naming 'rng'
  on every rank, ``strict=False`` restores, and one more step trains and commits.
- PerRank at the same world size: each rank's generators come back to that rank.
- A newest step that one rank cannot read (its shards damaged): ``restore(fallback=True)`` falls back
  to the same older step on every rank.
- Two "nodes" (two torchrun agents on loopback): save and consolidated load.
- A rank SIGKILLed mid-checkpoint, without an agent: the other rank gets a RankError naming it
  within about ``timeout_s``, the step never commits, a reopen leaves no staging folder. With
  torchrun's agent (no restarts): the job ends in bounded time with the same guarantees.
- Elastic: ``torchrun --max-restarts=1`` with a rank SIGKILLed on the first attempt resumes from the
  latest commit and ends with exactly the state of an uninterrupted run.
- Object stores (moto's S3, Azurite) at 2 ranks: save and consolidated load.
- Ranks that save different states (a key only one rank has, a plain value only one rank has, a
  shape that differs): a StateError naming the key on every rank, nothing committed.
"""

from __future__ import annotations

import json
import shutil
import signal
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import mpckpt
from harness.servers import free_port, s3_options
from tests.conftest import assert_same
from tests.launch import finish, ranks_without_agent, start, tail, torchrun, torchrun_cmd, worker_env  # noqa: F401

REPO = Path(__file__).resolve().parents[2]
WORKER = str(Path(__file__).with_name("dist_worker.py"))
STEPS = 4  # of the two-rank FSDP run, which the elastic run must end equal to


# -- launching -------------------------------------------------------------------------------------

# -- what the workers wrote ----------------------------------------------------------------------------

@dataclass
class Run:
    root: str
    out: Path
    world: int
    steps: int

    def full(self, step: int) -> dict[str, Any]:
        return torch.load(self.out / f"full-{step}.pt")

    def views(self, prefix: str = "view-a0") -> list[dict[str, Any]]:
        return [json.loads((self.out / f"{prefix}-r{r}.json").read_text()) for r in range(self.world)]

    def draws(self) -> list[dict[str, Any]]:
        return [torch.load(self.out / f"draw-r{r}.pt") for r in range(self.world)]


def train(tmp: Path, nproc: int, steps: int, *options: str, root: str | None = None,
          launcher: tuple[str, ...] = (), env: dict[str, str] | None = None) -> Run:
    root = root or str(tmp / "root")
    torchrun(nproc, "train", root, tmp / "out", "--steps", steps, *options, log=tmp / "log.txt", launcher=launcher,
             env=env)
    return Run(root, tmp / "out", nproc, steps)


def assert_equals_full(loaded: dict[str, Any], full: dict[str, Any]) -> None:
    """``mpckpt.load``'s model and optimizer moments are, bit for bit, the full tensors the ranks had."""
    assert set(loaded["model"]) == set(full["model"]) and full["model"]
    for name, tensor in full["model"].items():
        got = loaded["model"][name]
        assert got.dtype == tensor.dtype and torch.equal(got, tensor), name
    moments = loaded["optim"]["state"]
    assert set(moments) == set(full["optim"]) and full["optim"]
    for index, entries in full["optim"].items():
        assert {"step", "exp_avg", "exp_avg_sq"} <= set(entries)
        for key, tensor in entries.items():
            got = moments[index][key]
            assert got.dtype == tensor.dtype and torch.equal(got, tensor), (index, key)


def skeletons(folder: Path) -> list[dict[str, Any]]:
    files = sorted(folder.glob("r*-skeleton.json"))
    return [json.loads(f.read_text()) for f in files]


def staging_left(root: str | Path) -> list[str]:
    return sorted(p.name for p in Path(root).iterdir() if p.name.startswith(".tmp."))


def reopen(root: str | Path) -> list[int]:
    """Open the root in one process (its recovery scan runs) and close it; the committed steps."""
    with mpckpt.Checkpointer(root, workers=1) as ckpt:
        return ckpt.steps()


def copy_root(run: Run, dest: Path) -> str:
    shutil.copytree(run.root, dest)
    return str(dest)


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """FSDP2 + AdamW on 2 ranks, STEPS steps, every step saved."""
    return train(tmp_path_factory.mktemp("fsdp2"), 2, STEPS)


@pytest.fixture(scope="module")
def fsdp3(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """FSDP2 + AdamW on 3 ranks, with the copy of each save overlapped with the next step (overlap=True)."""
    return train(tmp_path_factory.mktemp("fsdp3"), 3, 3, "--overlap")


# -- saving ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("run_name", ["fsdp2", "fsdp3"])
def test_fsdp_checkpoints_load_as_the_full_tensors_and_every_rank_agrees_on_the_latest(request, run_name):
    run: Run = request.getfixturevalue(run_name)
    views = run.views()
    assert [v["latest"] for v in views] == [run.steps - 1] * run.world
    assert all(v["steps"] == list(range(run.steps)) for v in views), views
    for step in range(run.steps):
        loaded = mpckpt.load(run.root, step=step)
        assert_equals_full(loaded, run.full(step))
    folder = Path(run.root) / f"step_{run.steps - 1:010d}"
    assert [sk["rank"] for sk in skeletons(folder)] == list(range(run.world))
    for rank in range(run.world):
        assert list(folder.glob(f"r{rank:05d}-shard-*.safetensors")), f"rank {rank} stored no shard"
    rng = mpckpt.load(run.root)["rng"]  # a PerRank value: every rank's own, in rank order
    assert len(rng) == run.world
    assert not torch.equal(rng[0]["torch"], rng[1]["torch"])


def test_ddp_replicated_tensors_are_stored_once_and_spread_over_the_ranks(tmp_path):
    run = train(tmp_path, 2, 2, "--model", "ddp")
    assert [v["latest"] for v in run.views()] == [1, 1]
    assert_equals_full(mpckpt.load(run.root), run.full(1))
    folder = Path(run.root) / "step_0000000001"
    stored: dict[str, list[int]] = {}
    stored_bytes = [0, 0]
    for sk in skeletons(folder):
        for leaf in sk["leaves"]:
            if leaf["kind"] == "local":
                continue
            assert leaf["kind"] == "replicated", leaf
            if "parts" in leaf:
                stored.setdefault(leaf["name"], []).append(sk["rank"])
                assert leaf["writer"] == sk["rank"], leaf
                stored_bytes[sk["rank"]] += 4 * max(1, int(torch.tensor(leaf["shape"]).prod()))
    names = {leaf["name"] for sk in skeletons(folder) for leaf in sk["leaves"] if leaf["kind"] == "replicated"}
    assert names and set(stored) == names, names - set(stored)
    assert all(len(ranks) == 1 for ranks in stored.values()), stored
    assert min(stored_bytes) > 0.4 * sum(stored_bytes), stored_bytes  # the write load spread over both ranks


def test_two_nodes_on_loopback_save_and_load(tmp_path):
    port = free_port()
    procs = []
    for node in range(2):
        launcher = ("--nnodes=2", f"--node-rank={node}", "--master-addr=127.0.0.1", f"--master-port={port}")
        cmd = torchrun_cmd(1, "train", tmp_path / "root", tmp_path / "out", "--steps", 2, launcher=launcher)
        procs.append((start(cmd, tmp_path / f"log-{node}.txt", worker_env()), tmp_path / f"log-{node}.txt"))
    codes = [finish(proc, log) for proc, log in procs]
    assert codes == [0, 0], [tail(log) for _, log in procs]
    run = Run(str(tmp_path / "root"), tmp_path / "out", 2, 2)
    assert [v["latest"] for v in run.views()] == [1, 1]
    for step in range(2):
        assert_equals_full(mpckpt.load(run.root, step=step), run.full(step))
    assert len(skeletons(Path(run.root) / "step_0000000001")) == 2


@pytest.mark.parametrize("backend", [pytest.param("s3", marks=pytest.mark.s3),
                                     pytest.param("azure", marks=pytest.mark.azure)])
def test_object_store_roots(request, tmp_path, backend):
    name = f"mpckpt-{uuid.uuid4().hex[:12]}"
    if backend == "s3":
        url, opts = f"s3://{name}/run", s3_options(request.getfixturevalue("moto_server"), create=True)
    else:
        url, opts = f"az://{name}/run", {"connection_string": request.getfixturevalue("azurite_server"), "create": True}
    run = train(tmp_path, 2, 2, root=url, env=worker_env(DIST_WORKER_STORAGE_OPTIONS=json.dumps(opts)))
    assert [v["latest"] for v in run.views()] == [1, 1]
    for step in range(2):
        assert_equals_full(mpckpt.load(url, step=step, storage_options=opts), run.full(step))
    assert len(mpckpt.load(url, storage_options=opts)["rng"]) == 2


# -- restoring --------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("run_name", "nproc"), [("fsdp2", 3), ("fsdp3", 2), ("fsdp2", 1)])
def test_resharding_restore_into_fresh_objects_then_training_goes_on(request, tmp_path, run_name, nproc):
    saved: Run = request.getfixturevalue(run_name)
    root = copy_root(saved, tmp_path / "root")  # the saved run stays as it was for the other tests
    last = saved.steps - 1
    torchrun(nproc, "restore", root, tmp_path / "out", "--saved-world", saved.world, log=tmp_path / "log.txt")
    run = Run(root, tmp_path / "out", nproc, saved.steps + 1)
    for view in run.views("view"):
        assert view["strict_error"] is not None, "restore(strict=True) of a PerRank at another world size passed"
        assert view["strict_error"]["key"] == "rng" and "'rng'" in view["strict_error"]["message"], view
        assert view["restored"] == last and view["restored_bytes"] > 0, view
        assert view["latest"] == last + 1 and view["steps"] == list(range(last + 2)), view
    restored = torch.load(run.out / "restored.pt")
    assert_equals_full({"model": restored["model"], "optim": {"state": restored["optim"]}}, saved.full(last))
    after = run.full(last + 1)  # one more step, trained and saved at the new world size
    assert_equals_full(mpckpt.load(root), after)
    assert not torch.equal(after["model"]["0.weight"], restored["model"]["0.weight"])
    assert int(after["optim"][0]["step"]) == int(restored["optim"][0]["step"]) + 1


def test_per_rank_rng_state_comes_back_to_its_rank(tmp_path, fsdp2):
    root = copy_root(fsdp2, tmp_path / "root")
    torchrun(2, "restore", root, tmp_path / "out", "--saved-world", 2, log=tmp_path / "log.txt")
    run = Run(root, tmp_path / "out", 2, STEPS + 1)
    before, after = fsdp2.draws(), run.draws()
    for name in ("torch", "python", "numpy"):  # the ranks' generators differ: a swap would show
        assert not torch.equal(torch.as_tensor(before[0][name]), torch.as_tensor(before[1][name])), name
    for rank in range(2):
        assert_same(after[rank], before[rank], f"rank {rank}")
    assert all("strict_error" not in v and v["restored"] == STEPS - 1 for v in run.views("view"))
    restored = torch.load(run.out / "restored.pt")
    assert_equals_full({"model": restored["model"], "optim": {"state": restored["optim"]}}, fsdp2.full(STEPS - 1))


def test_a_step_one_rank_cannot_read_makes_every_rank_fall_back_together(tmp_path, fsdp2):
    root = copy_root(fsdp2, tmp_path / "root")
    last = Path(root) / f"step_{STEPS - 1:010d}"
    for shard in last.glob("r00001-shard-*.safetensors"):  # rank 1's own shards of the newest step
        data = bytearray(shard.read_bytes())
        data[-1] ^= 0xFF
        shard.write_bytes(bytes(data))
    torchrun(2, "restore", root, tmp_path / "out", "--saved-world", 2, "--fallback", log=tmp_path / "log.txt")
    views = Run(root, tmp_path / "out", 2, STEPS).views("view")
    assert [v["restored"] for v in views] == [STEPS - 2, STEPS - 2], views  # the same step on every rank
    assert "trying an older one" in tail(tmp_path / "log.txt")
    restored = torch.load(tmp_path / "out" / "restored.pt")
    assert_equals_full({"model": restored["model"], "optim": {"state": restored["optim"]}}, fsdp2.full(STEPS - 2))
    assert not last.exists()  # rank 0 moved the damaged step aside, whole, so the job saves it again
    aside = list(Path(root).glob(f"damaged.{last.name}.*"))
    assert len(aside) == 1 and sorted(p.name for p in aside[0].iterdir()) == sorted(
        p.name for p in (Path(fsdp2.root) / last.name).iterdir())


# -- failures -------------------------------------------------------------------------------------------

def test_a_rank_killed_mid_checkpoint_fails_the_step_on_the_others_without_an_agent(tmp_path):
    root, out = tmp_path / "root", tmp_path / "out"
    codes, logs = ranks_without_agent(tmp_path, [sys.executable, WORKER, "kill", str(root), str(out), "--timeout-s", "10"])
    assert codes == [0, -signal.SIGKILL], [tail(log) for log in logs]
    seen = json.loads((out / "kill-r0.json").read_text())
    error = seen["error"]
    assert error is not None, seen
    assert error["type"] == "RankError" and error["ranks"] == [1] and error["step"] == 2, error
    assert seen["elapsed"] < 60 and seen["latest"] == 1, seen
    assert not (root / "step_0000000002").exists()
    assert reopen(root) == [1]
    assert staging_left(root) == []
    assert set(mpckpt.load(root)["model"]) == {"0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"}


def test_a_rank_killed_mid_checkpoint_under_torchrun_ends_the_job_and_commits_nothing(tmp_path):
    root = tmp_path / "root"
    started = time.monotonic()
    code = torchrun(2, "kill", root, tmp_path / "out", "--timeout-s", "10", launcher=("--max-restarts=0",),
                    log=tmp_path / "log.txt", ok=False)
    assert code != 0 and time.monotonic() - started < 120
    assert sorted(p.name for p in root.glob("step_*")) == ["step_0000000001"]
    assert staging_left(root), "the agent stopped rank 0 while it waited: step 2's staging folder should be left"
    assert reopen(root) == [1]
    assert staging_left(root) == []
    assert mpckpt.load(root)["optim"]["state"][0]["step"].item() == 1  # step 1's state (one optimizer step)


def test_elastic_restart_resumes_from_the_latest_commit_and_ends_as_an_uninterrupted_run(tmp_path, fsdp2):
    crash_at = 2
    run = train(tmp_path, 2, STEPS, "--crash-at", crash_at, launcher=("--max-restarts=1",))
    assert not list(run.out.glob("view-a0-*")), "the first attempt was not interrupted"
    views = run.views("view-a1")
    assert {v["resumed"] for v in views} <= {crash_at - 1, crash_at}, views
    assert len({v["resumed"] for v in views}) == 1 and [v["latest"] for v in views] == [STEPS - 1] * 2, views
    assert_equals_full(mpckpt.load(run.root), fsdp2.full(STEPS - 1))
    assert_same(mpckpt.load(fsdp2.root), mpckpt.load(run.root))  # the moments, the steps, every rank's generators


def test_elastic_restart_restores_from_memory_on_every_rank(tmp_path, fsdp2):
    """Steps after 0 but the last are kept in memory only; rank 1 is killed after step 2's save:
    the restarted attempt restores step 2 from this node's memory on both ranks (every rank's
    snapshot is read where it needs it) and ends as an uninterrupted run."""
    run = train(tmp_path, 2, STEPS, "--crash-at", 2, "--memory-after", 0, launcher=("--max-restarts=1",))
    views = run.views("view-a1")
    assert [(v["resumed"], v["source"]) for v in views] == [(2, "memory")] * 2, views
    assert [v["latest"] for v in views] == [STEPS - 1] * 2, views
    assert_equals_full(mpckpt.load(run.root), fsdp2.full(STEPS - 1))
    assert_same(mpckpt.load(fsdp2.root), mpckpt.load(run.root))


def test_ranks_saving_different_states_get_a_state_error_naming_the_key(tmp_path):
    torchrun(2, "mismatch", tmp_path / "roots", tmp_path / "out", log=tmp_path / "log.txt")
    for case, key in [("extra-key", "extra"), ("extra-value", "epoch"), ("shape", "counter")]:
        for rank in range(2):
            seen = json.loads((tmp_path / "out" / f"mismatch-{case}-r{rank}.json").read_text())
            assert seen["error"] is not None, (case, rank, seen)
            assert seen["error"]["key"] == key and f"'{key}'" in seen["error"]["message"], (case, rank, seen)
            assert seen["latest"] is None, (case, rank, seen)
        assert not list((tmp_path / "roots" / case).glob("step_*")), case
