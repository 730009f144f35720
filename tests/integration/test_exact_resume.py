"""Exact resume: a training run SIGKILLed and restarted is bit-identical to one that never stopped.

- ``exact_trainer`` (dropout, AdamW, a cosine schedule, a shuffled dataset augmented in two
  DataLoader workers, ``RNGState``, ``ResumableLoader``) killed with SIGKILL at three
  pseudo-random steps and restarted each time: every step's loss, parameters and batch, and the
  final checkpoint, are bit for bit the uninterrupted run's; each resume starts exactly where the
  last committed step left the data.
- The same check sees a resume that is not exact: a plain ``DataLoader(shuffle=True)`` draws a
  new order when it restarts, and the losses after the resume differ.
- ``ResumableLoader`` counts what the loop received, not what workers prefetched; an epoch
  that was used up resumes with the next one.
- ``SeededDataset``: randomness drawn in workers is the same after a mid-epoch resume, and the
  same whatever the number of workers; without it, it is not.
- ``ResumableSampler``: ranks get disjoint slices of one epoch order (padded or cut as
  ``DistributedSampler``); bad settings are a ``ConfigError``, a state of another run a
  ``StateError``, each naming the setting.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

import mpckpt
from mpckpt.errors import ConfigError, StateError
from tests.conftest import assert_same
from tests.integration.exact_trainer import BATCH, BATCHES_PER_EPOCH, N_SAMPLES, TOTAL_STEPS

REPO = Path(__file__).resolve().parents[2]


def train(root: Path, *args: str, kill_at: int | None = None) -> tuple[list[int], dict[int, list[str]]]:
    """Run the trainer (SIGKILLed once it printed step ``kill_at``); its resume line and step lines."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.integration.exact_trainer", str(root), *args], cwd=REPO,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout is not None
    resumed: list[int] = []
    steps: dict[int, list[str]] = {}
    for line in proc.stdout:
        word, *fields = line.split()
        if word == "resumed":
            resumed = [int(f) for f in fields]
        elif word == "step":
            steps[int(fields[0])] = fields[1:]
            if int(fields[0]) == kill_at:
                os.kill(proc.pid, signal.SIGKILL)  # the trainer only; its DataLoader workers are orphaned
                break
    # INVARIANT: no read to the end after a kill: orphaned workers hold the pipe for a while
    code = proc.wait(60)
    assert code == (-signal.SIGKILL if kill_at is not None else 0), f"the trainer ended with {code}"
    return resumed, steps


def losses(steps: dict[int, list[str]]) -> torch.Tensor:
    return torch.tensor([float.fromhex(fields[1]) for _, fields in sorted(steps.items())], dtype=torch.float64)


def assert_as_reference(steps: dict[int, list[str]], reference: dict[int, list[str]]) -> None:
    assert torch.equal(losses(steps), losses({s: reference[s] for s in steps}))
    for step, fields in steps.items():
        assert fields == reference[step], f"step {step}: {fields} != {reference[step]}"


def position_after(step: int) -> list[int]:
    """Where in the data a run resumes after ``step`` was the last committed: epoch, samples used."""
    epoch, batches = divmod(step, BATCHES_PER_EPOCH)
    return [epoch, min((batches + 1) * BATCH, N_SAMPLES)]


def test_sigkilled_training_resumes_bit_identical(tmp_path):
    _, reference = train(tmp_path / "reference", "--num-workers", "2")
    assert sorted(reference) == list(range(TOTAL_STEPS))
    rng = random.Random(12)
    epoch = BATCHES_PER_EPOCH
    kills = [rng.randint(3, epoch - 3), rng.randint(epoch + 2, 2 * epoch - 2), rng.randint(2 * epoch, 3 * epoch - 3)]
    root, seen, starts = tmp_path / "killed", {}, []
    for kill_at in [*kills, None]:
        (start, *where), steps = train(root, "--num-workers", "2", "--step-sleep", "0.05", kill_at=kill_at)
        assert start <= (max(seen) + 1 if seen else 0) and (not starts or start > starts[-1]), (start, starts)
        if start:
            assert where == position_after(start - 1)  # the loop's count, not the workers' prefetch
        starts.append(start)
        assert_as_reference(steps, reference)
        seen.update(steps)
    assert sorted(seen) == list(range(TOTAL_STEPS))
    assert any(0 < start % epoch for start in starts[1:]), f"no resume mid-epoch: {starts}"
    final, uninterrupted = mpckpt.load(root), mpckpt.load(tmp_path / "reference")
    assert final["data"] == {**uninterrupted["data"], "epoch": 2, "consumed": N_SAMPLES}
    for name, tensor in final["model"].items():
        assert torch.equal(tensor, uninterrupted["model"][name]), name
    assert_same(uninterrupted, final)  # and AdamW's moments, the schedule, every generator, the data position


def test_the_check_sees_a_resume_that_is_not_exact(tmp_path):
    _, reference = train(tmp_path / "reference", "--plain")
    _, before = train(tmp_path / "killed", "--plain", "--step-sleep", "0.05", kill_at=5)
    assert_as_reference(before, reference)  # the same run until the kill
    (start, *_), after = train(tmp_path / "killed", "--plain")
    assert start in (4, 7)  # after the save of step 3 or 6: mid-epoch (a plain loader is exact at an epoch's start)
    # RNGState is restored, but a plain DataLoader draws a new order when it restarts mid-epoch
    assert [after[s][3] for s in range(start, start + 3)] != [reference[s][3] for s in range(start, start + 3)]
    assert not torch.equal(losses(after), losses({s: reference[s] for s in after}))


def indices(batches: list[list[torch.Tensor]]) -> list[int]:
    return [i for (batch,) in batches for i in batch.tolist()]


def test_the_loop_count_is_exact_with_workers_and_an_epoch_used_up_resumes_with_the_next():
    dataset = TensorDataset(torch.arange(50))

    def loader(num_workers: int) -> mpckpt.ResumableLoader:
        return mpckpt.ResumableLoader(DataLoader(dataset, batch_size=4, num_workers=num_workers,
                                                 sampler=mpckpt.ResumableSampler(dataset, seed=5)))

    whole = loader(0)
    epochs = [indices(list(whole)) for _ in range(3)]
    assert [sorted(e) for e in epochs] == [list(range(50))] * 3 and epochs[0] != epochs[1] != epochs[2]
    assert whole.state_dict()["epoch"] == 3 and whole.consumed == 0

    interrupted = loader(2)
    it = iter(interrupted)
    first = [next(it) for _ in range(3)]
    assert interrupted.state_dict()["consumed"] == 12 and interrupted.epoch == 0
    # the DataLoader asked the sampler for more than the loop received: a sampler's count runs ahead
    ahead = mpckpt.ResumableSampler(dataset, seed=5)
    ahead_it = iter(DataLoader(dataset, batch_size=4, sampler=ahead, num_workers=2))
    [next(ahead_it) for _ in range(3)]
    assert ahead.consumed > 12
    del it, ahead_it

    resumed = loader(2)
    resumed.load_state_dict(interrupted.state_dict())
    assert indices(first) + indices(list(resumed)) == epochs[0]
    assert indices(list(resumed)) == epochs[1]

    used_up = loader(0)
    used_up.load_state_dict({**interrupted.state_dict(), "epoch": 1, "consumed": 50})
    assert list(used_up) == [] and used_up.epoch == 2  # the epoch's loop ends at once, as it would have
    assert indices(list(used_up)) == epochs[2]
    # a DistributedSampler-style loop keeps the restored position: set_epoch to the current epoch
    again = loader(0)
    again.load_state_dict(interrupted.state_dict())
    again.set_epoch(0)
    assert indices(list(again)) == epochs[0][12:]
    again.set_epoch(2)
    assert indices(list(again)) == epochs[2]


class Augmented(Dataset):
    """Every load draws from the worker's torch, Python and NumPy generators."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> torch.Tensor:
        import numpy

        return torch.stack([torch.tensor(float(i)), torch.rand(()), torch.tensor(random.random()),
                            torch.tensor(numpy.random.rand())]).double()


def augmented(seeded: bool, num_workers: int, state: dict | None = None) -> mpckpt.ResumableLoader:
    dataset = mpckpt.SeededDataset(Augmented()) if seeded else Augmented()
    loader = mpckpt.ResumableLoader(DataLoader(dataset, batch_size=4, num_workers=num_workers,
                                               sampler=mpckpt.ResumableSampler(dataset, seed=1)))
    if state is not None:
        loader.load_state_dict(state)
    return loader


@pytest.mark.parametrize("seeded", [True, False])
def test_seeded_dataset_makes_randomness_in_workers_exact_mid_epoch(seeded):
    torch.manual_seed(3)
    before = torch.get_rng_state()
    reference = torch.cat(list(augmented(seeded, 2)))
    assert torch.equal(torch.get_rng_state(), before)  # the training process's generator was not drawn from
    loader = augmented(seeded, 2)
    it = iter(loader)
    first = [next(it) for _ in range(3)]  # 3 batches, then the process dies
    del it
    resumed = torch.cat(first + list(augmented(seeded, 2, loader.state_dict())))
    assert torch.equal(resumed[:, 0], reference[:, 0])  # the same items in the same order either way
    assert torch.equal(resumed, reference) is seeded
    if seeded:  # the numbers belong to the item, not to the worker that loaded it
        assert torch.equal(torch.cat(list(augmented(True, 1))), reference)


def test_ranks_get_disjoint_slices_of_one_epoch_order_and_share_one_state():
    whole = mpckpt.ResumableSampler(10, seed=4).order(2)
    padded = whole + whole[:2]
    for rank in range(3):
        sampler = mpckpt.ResumableSampler(10, seed=4, rank=rank, world_size=3)
        sampler.set_epoch(2)
        assert list(sampler) == padded[rank::3] and len(sampler) == 4
        cut = mpckpt.ResumableSampler(range(10), seed=4, rank=rank, world_size=3, drop_last=True)
        assert cut.order(2) == whole[:9][rank::3] and len(cut) == 3
    assert mpckpt.ResumableSampler(6, shuffle=False, rank=1, world_size=2).order(0) == [1, 3, 5]
    assert mpckpt.ResumableSampler(10, seed=5).order(2) != whole != mpckpt.ResumableSampler(10, seed=4).order(3)
    # the state holds no rank: rank 0's restores rank 2 at the same place
    rank0 = mpckpt.ResumableSampler(10, seed=4, rank=0, world_size=3)
    rank0.set_epoch(2)
    next(iter(rank0))
    rank2 = mpckpt.ResumableSampler(10, seed=4, rank=2, world_size=3)
    rank2.load_state_dict(rank0.state_dict())
    assert list(rank2) == padded[2::3][1:]


@pytest.mark.parametrize(("make", "match"), [
    (lambda: mpckpt.ResumableSampler(10, seed=-1), "seed=-1"),
    (lambda: mpckpt.ResumableSampler(10, seed=True), "seed=True"),
    (lambda: mpckpt.ResumableSampler(10, rank=2, world_size=2), "rank=2 with world_size=2"),
    (lambda: mpckpt.ResumableSampler(10, world_size=0), "world_size=0"),
    (lambda: mpckpt.ResumableSampler(0), "the dataset has 0 samples"),
    (lambda: mpckpt.ResumableSampler(3, world_size=4, drop_last=True), "leave every rank nothing"),
    (lambda: mpckpt.ResumableSampler(iter([1])), "not a list_iterator"),
    (lambda: mpckpt.ResumableSampler(3).set_epoch(-1), "epoch=-1"),
    (lambda: mpckpt.ResumableLoader(DataLoader(range(4), batch_size=2, shuffle=True)), "from a RandomSampler"),
    (lambda: mpckpt.ResumableLoader(DataLoader(range(4), sampler=mpckpt.ResumableSampler(5))), "for 5 samples"),
    (lambda: mpckpt.ResumableLoader(DataLoader(range(4), sampler=mpckpt.ResumableSampler(4),
                                               generator=torch.Generator())), "generator="),
    (lambda: mpckpt.ResumableLoader(range(4)), "not a range"),
    (lambda: mpckpt.ResumableLoader(DataLoader(range(4), sampler=mpckpt.ResumableSampler(4), num_workers=1,
                                               in_order=False)), "in_order=False"),
    (lambda: mpckpt.ResumableLoader(DataLoader(mpckpt.SeededDataset(range(4)), sampler=mpckpt.ResumableSampler(4),
                                               num_workers=1, persistent_workers=True)), "persistent_workers=True"),
])
def test_bad_settings_are_config_errors_naming_the_setting(make, match):
    with pytest.raises(ConfigError, match=match):
        make()


def test_a_state_of_another_run_is_a_state_error_naming_the_setting(tmp_path):
    sampler = mpckpt.ResumableSampler(10, seed=4, world_size=2)
    next(iter(sampler))
    with mpckpt.Checkpointer(tmp_path / "run", workers=1) as ckpt:
        ckpt.save(0, {"data": sampler}, mode="sync")
        restored = mpckpt.ResumableSampler(10, seed=4, world_size=2)
        assert ckpt.restore({"data": restored}) == 0 and restored.consumed == 1
        for other, match in [(mpckpt.ResumableSampler(10, seed=5, world_size=2), "seed=4.*seed=5"),
                             (mpckpt.ResumableSampler(11, seed=4, world_size=2), "dataset of 10 samples and this sampler's has 11"),
                             (mpckpt.ResumableSampler(10, seed=4), "world_size=2 and this sampler has world_size=1; restore with as many ranks"),
                             (mpckpt.ResumableSampler(10, seed=4, world_size=2, shuffle=False), "shuffle=True")]:
            with pytest.raises(StateError, match=match):
                ckpt.restore({"data": other})
    state = sampler.state_dict()
    for bad, match in [({**state, "consumed": 6}, "6 samples"), ({**state, "epoch": -1}, "epoch=-1"),
                       ({"epoch": 0}, "does not hold a ResumableSampler")]:
        with pytest.raises(StateError, match=match):
            mpckpt.ResumableSampler(10, seed=4, world_size=2).load_state_dict(bad)


FORKING_TRAINER = """
import os, sys, time
import mpckpt
ckpt = mpckpt.Checkpointer(sys.argv[1], workers=1)
child = os.fork()  # as a DataLoader worker is forked
if child == 0:
    time.sleep(60)  # lives on until the test kills it
    os._exit(0)
print(child, flush=True)
time.sleep(60)  # until the test kills it
"""


def test_a_killed_trainers_forked_child_does_not_keep_the_root_locked(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", FORKING_TRAINER, str(tmp_path / "run")], cwd=REPO,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    try:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        os.kill(child, 0)  # the child lives on, and the next trainer opens the root all the same
        with mpckpt.Checkpointer(tmp_path / "run", workers=1) as ckpt:
            assert ckpt.latest_step is None
    finally:
        os.kill(child, signal.SIGKILL)
