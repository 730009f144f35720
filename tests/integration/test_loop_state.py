"""``LoopState`` through a real Checkpointer: restore, ``mpckpt.load``, an overlapped save, strictness, ``PerRank``,
and a two-rank job (torchrun, gloo): a holder the same on every rank is stored once, one under ``PerRank``
goes back to each rank."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mpckpt
from harness.servers import free_port
from mpckpt.errors import StateError

REPO = Path(__file__).resolve().parents[2]


def carried(seed: int) -> mpckpt.LoopState:
    """What a loop carries, made from ``seed``: a hidden state with autograd history, numbers, a generator."""
    weight = torch.randn(4, requires_grad=True, generator=torch.Generator().manual_seed(seed))
    return mpckpt.LoopState(hidden=((weight * 2).expand(2, 4), weight.sin().repeat(2, 1)), lr=20.0 / (seed + 1),
                            best_val=math.inf, total_loss=float(seed), i=35 * seed,
                            gen=torch.Generator().manual_seed(seed))


def test_restore_gives_the_saved_values_back_and_load_gives_a_plain_dict(tmp_path):
    loop = carried(1)
    loop.best_val = 4.5
    model = torch.nn.Linear(4, 2)
    state = {"model": model, "loop": loop}
    with mpckpt.Checkpointer(tmp_path / "run", workers=1) as ckpt:
        ckpt.save(0, state, mode="sync")
        saved = loop.state_dict()
        saved["hidden"], saved["gen"] = tuple(h.clone() for h in saved["hidden"]), saved["gen"].clone()
        replay = torch.Generator()
        replay.set_state(saved["gen"])
        next_draw = torch.rand(3, generator=replay)
        loop.hidden[1].add_(1)  # the loop goes on: in place, reassigned, drawn from
        loop.hidden, loop.lr, loop.total_loss, loop.i = (torch.zeros(2, 4), torch.zeros(2, 4)), 0.1, 99.0, 0
        torch.rand(5, generator=loop.gen)
        generator = loop.gen
        assert ckpt.restore(state) == 0
    assert torch.equal(loop.hidden[0], saved["hidden"][0]) and torch.equal(loop.hidden[1], saved["hidden"][1])
    assert (loop.lr, loop.best_val, loop.total_loss, loop.i) == (10.0, 4.5, 1.0, 35)
    assert loop.gen is generator and torch.equal(torch.rand(3, generator=loop.gen), next_draw)
    plain = mpckpt.load(tmp_path / "run")["loop"]
    assert sorted(plain) == ["best_val", "gen", "hidden", "i", "lr", "total_loss"]
    assert type(plain["hidden"]) is tuple and torch.equal(plain["hidden"][1], saved["hidden"][1])
    assert plain["gen"].dtype == torch.uint8 and torch.equal(plain["gen"], saved["gen"])
    assert (plain["lr"], plain["best_val"], plain["i"]) == (10.0, 4.5, 35)


def test_an_overlapped_save_holds_the_values_of_the_save_call(tmp_path):
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loop = mpckpt.LoopState(hidden=(torch.ones(64, 64), torch.ones(64, 64)), total_loss=1.0)
    state = {"model": model, "optim": opt, "loop": loop}
    with mpckpt.Checkpointer(tmp_path / "run", workers=1, overlap=True) as ckpt:
        for step in range(3):
            future = ckpt.save(step, state)
            loop.hidden[0].mul_(3)  # changed in place at once, before any optimizer step
            loop.hidden = (loop.hidden[0] + 1, loop.hidden[1] * 2)
            loop.total_loss += 1.0
            model(torch.ones(1, 4)).sum().backward()
            opt.step()
            assert future is not None
            future.result()
    for step in range(3):
        saved = mpckpt.load(tmp_path / "run", step=step)["loop"]
        first = torch.ones(64, 64)
        for _ in range(step):
            first = first * 3 + 1
        assert torch.equal(saved["hidden"][0], first) and torch.equal(saved["hidden"][1], torch.full((64, 64), 2.0**step))
        assert saved["total_loss"] == 1.0 + step


def test_a_checkpoint_without_a_declared_variable_is_refused_unless_strict_is_false(tmp_path):
    with mpckpt.Checkpointer(tmp_path / "run", workers=1) as ckpt:
        ckpt.save(0, {"loop": mpckpt.LoopState(lr=5.0, best_val=2.0)}, mode="sync")
        newer = mpckpt.LoopState(lr=20.0, best_val=math.inf, hidden=(torch.zeros(1),))  # the script forgot it before
        with pytest.raises(StateError, match="lacks variable 'hidden' that this LoopState declares") as e:
            ckpt.restore({"loop": newer})
        assert e.value.key == "loop.hidden" and newer.lr == 20.0  # the full key path of the state
        with pytest.raises(StateError, match="holds variable 'best_val' that this LoopState does not declare"):
            ckpt.restore({"loop": mpckpt.LoopState(lr=20.0)})
        assert ckpt.restore({"loop": newer}, strict=False) == 0
    assert (newer.lr, newer.best_val) == (5.0, 2.0) and torch.equal(newer.hidden[0], torch.zeros(1))


def test_a_value_that_cannot_be_stored_is_refused_naming_the_variable(tmp_path):
    with mpckpt.Checkpointer(tmp_path / "run", workers=1) as ckpt:
        with pytest.raises(StateError, match="'loop.sampler'"):
            ckpt.save(0, {"loop": mpckpt.LoopState(lr=1.0, sampler=object())})
        assert ckpt.latest_step is None


def test_per_rank_loop_state_round_trips_in_one_process(tmp_path):
    shared, own = mpckpt.LoopState(lr=2.5), mpckpt.LoopState(hidden=torch.arange(3.0), total_loss=7.0)
    state = {"loop": shared, "rank_loop": mpckpt.PerRank(own)}
    with mpckpt.Checkpointer(tmp_path / "run", workers=1) as ckpt:
        ckpt.save(0, state, mode="sync")
        shared.lr, own.hidden, own.total_loss = 0.0, torch.zeros(3), 0.0
        assert ckpt.restore(state) == 0
    assert shared.lr == 2.5 and own.total_loss == 7.0 and torch.equal(own.hidden, torch.arange(3.0))
    plain = mpckpt.load(tmp_path / "run")
    assert plain["loop"] == {"lr": 2.5} and plain["rank_loop"][0]["total_loss"] == 7.0  # one value per rank


def test_in_a_multi_rank_job_loop_state_is_replicated_and_per_rank_loop_state_goes_back_to_its_rank(tmp_path):
    root, out = tmp_path / "run", tmp_path / "out"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
               str(Path(__file__).with_name("loop_dist_worker.py")), str(root), str(out)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run(command, cwd=REPO, env={**env, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for rank in range(2):
        got = json.loads((out / f"r{rank}.json").read_text())
        assert (got["restored"], got["lr"], got["epoch"], got["total_loss"]) == (0, 5.0, 2, 10.0 + rank)
        assert got["hidden"] == [[[float(rank)] * 3] * 2, [[-float(rank)] * 3] * 2]
    plain = mpckpt.load(root)  # one process: the replicated holder once, the per-rank one as a list in rank order
    assert plain["loop"] == {"lr": 5.0, "best_val": 1.5, "epoch": 2}
    assert [own["total_loss"] for own in plain["own"]] == [10.0, 11.0]
    assert torch.equal(plain["own"][1]["hidden"][1], torch.full((2, 3), -1.0))
