"""``python -m mpckpt.run``'s command line, the generations' store protocol and ``mpckpt.heal``'s
refusals, in one process (the jobs themselves: ``tests/integration/test_heal_in_job.py``)."""

from __future__ import annotations

import datetime
import socket
import sys
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

import mpckpt
from mpckpt import _generations as gens
from mpckpt._supervisor import Plan, Supervisor
from mpckpt.errors import HealError
from mpckpt.run import parse


def test_torchruns_flags_make_the_plan():
    plan = parse(["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "node0:29400", "--nproc-per-node", "4",
                  "--max-restarts", "5", "--rdzv-id", "job7", "train.py", "--lr", "3"])
    assert (plan.nnodes, plan.node_rank, plan.host, plan.port, plan.nproc_per_node, plan.max_restarts,
            plan.run_id) == (2, 1, "node0", 29400, 4, 5, "job7")
    assert plan.argv == [sys.executable, "-u", "train.py", "--lr", "3"]
    assert plan.world_size == 8
    assert plan.spares == 1 and parse(["--spares", "0", "train.py"]).spares == 0  # warm spares: mpckpt.run's own
    assert parse(["-m", "--standalone", "pkg.train"]).argv == [sys.executable, "-u", "-m", "pkg.train"]


@pytest.mark.parametrize(("argv", "says"), [
    (["--nnodes", "1:4", "t.py"], "fixed number of nodes"),
    (["--rdzv-backend", "c10d", "t.py"], "static"),
    (["--nnodes", "2", "t.py"], "--rdzv-endpoint"),
    (["--nnodes", "2", "--standalone", "t.py"], "--standalone is one node"),
    (["--max-restarts", "-1", "t.py"], "--max-restarts=-1"),
    (["--spares", "-1", "t.py"], "--spares=-1"),
    (["--rdzv-endpoint", "nohost", "t.py"], "HOST:PORT"),
])
def test_what_it_cannot_do_is_refused_by_name(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2
    assert says in capsys.readouterr().err


def test_a_rank_gets_torchruns_environment_and_its_generation():
    plan = Plan(argv=["x"], nproc_per_node=4, nnodes=2, node_rank=1, host="h", port=7, max_restarts=3, run_id="r")
    env = Supervisor(plan, environ={"PATH": "/bin"}).env_of(6, generation=2)
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                                "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID",
                                "TORCHELASTIC_USE_AGENT_STORE", "MPCKPT_RUN", "OMP_NUM_THREADS", "PATH")} == {
        "RANK": "6", "LOCAL_RANK": "2", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
        "MASTER_ADDR": "h", "MASTER_PORT": "7", "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_RUN_ID": "r",
        "TORCHELASTIC_USE_AGENT_STORE": "True", "MPCKPT_RUN": "1", "OMP_NUM_THREADS": "1", "PATH": "/bin"}


def test_the_generations_store_protocol():
    store = dist.HashStore()
    assert gens.current(store) == 0 and gens.lost_in(store, 1) == [] and gens.stopped(store) is None
    assert gens.wait_for_newer(store, 0, timeout_s=0.05) is None  # bounded
    store.add(gens.GENERATION, 1)
    store.set(gens.lost_key(1), "1,3")
    assert gens.wait_for_newer(store, 0, timeout_s=5) == 1 and gens.lost_in(store, 1) == [1, 3]
    store.set(gens.STOP, "too many failures")
    assert gens.stopped(store) == "too many failures" and gens.wait_for_newer(store, 1, timeout_s=5) is None


def test_who_was_lost_is_read_even_when_the_generation_is_seen_first():
    """A launcher counts the generation, then writes who was lost and when: a survivor that saw the
    count waits (bounded) for the rest instead of reporting no rank lost."""
    import threading

    store = dist.HashStore()
    store.add(gens.GENERATION, 1)  # counted; the rest comes 0.3 s later
    assert gens.lost_in(store, 1) == [] and gens.began(store, 1) is None  # not waiting: not there yet

    def write() -> None:
        time.sleep(0.3)  # the scenario: the launcher descheduled between the count and the write
        store.set(gens.lost_key(1), "1")
        store.set(gens.began_key(1), repr(1234.5))

    writer = threading.Thread(target=write)
    writer.start()
    try:
        assert gens.lost_in(store, 1, wait_s=10) == [1]
        assert gens.began(store, 1, wait_s=10) == 1234.5
    finally:
        writer.join(10)
    assert gens.lost_in(store, 2, wait_s=0.05) == []  # never written: bounded


def test_heal_raises_again_what_is_not_a_lost_rank(tmp_path, monkeypatch):
    with mpckpt.Checkpointer(tmp_path / "root", workers=1) as ckpt:
        state = {"x": [1]}
        bug = ValueError("a bug in the loop")
        with pytest.raises(ValueError) as e:  # not a failure a lost rank makes
            mpckpt.heal(ckpt, state, bug)
        assert e.value is bug
        monkeypatch.delenv("MPCKPT_RUN", raising=False)
        failed = RuntimeError("Connection closed by peer")
        with pytest.raises(RuntimeError) as e:  # no launcher to start a replacement
            mpckpt.heal(ckpt, state, failed)
        assert e.value is failed and "python -m mpckpt.run" in "".join(getattr(e.value, "__notes__", []))
        monkeypatch.setenv("MPCKPT_RUN", "1")
        monkeypatch.setattr(mpckpt.process_group, "made_with", None)
        with pytest.raises(HealError, match="mpckpt.init_process_group"):
            mpckpt.heal(ckpt, state, failed)


@pytest.fixture
def launcher_store(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A store where the launcher's would be (a real TCPStore on 127.0.0.1), this process a rank under
    ``mpckpt.run`` whose group was made with ``mpckpt.init_process_group``."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))
    monkeypatch.setenv("MPCKPT_RUN", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setattr(mpckpt.process_group, "made_with", ("gloo", {}))
    return store


def test_a_job_that_is_stopping_is_refused_saying_why(tmp_path, launcher_store):
    launcher_store.set(gens.STOP, "more than --max-restarts=0 failures")
    failed = RuntimeError("Connection closed by peer")
    with mpckpt.Checkpointer(tmp_path / "root", workers=1) as ckpt:
        with pytest.raises(HealError, match="stopping and cannot heal: more than --max-restarts=0") as e:
            mpckpt.heal(ckpt, {"x": [1]}, failed, loss_wait_s=5)
        assert e.value.__cause__ is failed
        ckpt.save(0, {"x": [1]}, mode="sync")  # refused before it let go of anything: still open


def test_no_replacement_in_time_raises_the_failure_again_saying_so(tmp_path, launcher_store):
    failed = RuntimeError("Connection closed by peer")
    with mpckpt.Checkpointer(tmp_path / "root", workers=1) as ckpt:
        with pytest.raises(RuntimeError) as e:
            mpckpt.heal(ckpt, {"x": [1]}, failed, loss_wait_s=0.3)
    assert e.value is failed
    assert "no launcher started a replacement within 0 s" in "".join(getattr(e.value, "__notes__", []))


def test_a_launcher_that_is_gone_is_a_heal_error_naming_its_store(tmp_path, launcher_store, monkeypatch):
    with socket.socket() as s:  # a port nothing listens on, in place of the launcher's
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    monkeypatch.setenv("MASTER_PORT", str(closed))
    with mpckpt.Checkpointer(tmp_path / "root", workers=1) as ckpt:
        with pytest.raises(HealError, match=f"store at 127.0.0.1:{closed} does not answer"):
            mpckpt.heal(ckpt, {"x": [1]}, RuntimeError("Connection closed by peer"), loss_wait_s=0.5)


@pytest.fixture
def one_rank_group() -> Any:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_state_still_bound_to_the_failed_group_is_named(one_rank_group):
    """What ``heal`` refuses after ``rebuild``: a DDP wrapper, and FSDP2 parameters and optimizer state
    on a mesh of the group that failed; plain modules and tensors heal in place."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from mpckpt.healing import bound_to_old_group

    plain, wrapped, sharded = torch.nn.Linear(2, 2), DDP(torch.nn.Linear(2, 2)), torch.nn.Linear(2, 2)
    fully_shard(sharded, mesh=init_device_mesh("cpu", (1,)))
    optim = torch.optim.AdamW(sharded.parameters())
    state = {"plain": plain, "ddp": wrapped, "fsdp": sharded, "optim": optim, "blob": torch.ones(3)}
    assert bound_to_old_group(state) == []  # the group is alive
    dist.destroy_process_group()
    assert bound_to_old_group(state) == ["ddp", "fsdp.weight", "fsdp.bias", "optim.param_groups.0.0",
                                         "optim.param_groups.0.1"]
