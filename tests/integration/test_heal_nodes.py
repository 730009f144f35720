"""A node lost from a job under ``python -m mpckpt.run`` on simulated nodes (``harness.nodes``): a fresh
node's launcher takes its place, its rank restores from the copy on the surviving node, the survivor
heals in place.

Two nodes of one rank each run ``heal_worker.py`` (DDP, ``peer_copies=1``, every step to memory and a
little pause after it, so that each save's copy reaches the other node). Once rank 1 saved step
``LOSE_AFTER``, node 1 is lost (every process on it, its launcher too, and its ``/dev/shm``); a fresh
node 1 starts and its launcher (``--node-rank 1``, the same rendezvous) joins the job in place of the
lost one. What must hold: both launchers exit 0; rank 0 is the process it was, healed in place from
its own ``"memory"``; rank 1's new process restored the same step from its ``"peer"`` copy on node 0;
both restored bit for bit what they saved at that step, and ended bit for bit as an uninterrupted run
on the same nodes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.nodes import Cluster, Node, namespaces_unavailable
from harness.servers import free_port
from tests.conftest import assert_same
from tests.waiting import wait_until

if (_why := namespaces_unavailable()) is not None:
    pytest.skip(_why, allow_module_level=True)

WORKER = str(Path(__file__).with_name("heal_worker.py"))
REPO = Path(__file__).resolve().parents[2]
STEPS, LOSE_AFTER = 12, 6
JOB_TIMEOUT_S = 180
_DROPPED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "MPCKPT_NODE_ID", "MPCKPT_RUN")


def launch(node: Node, node_rank: int, port: int, tmp: Path, label: str) -> subprocess.Popen:
    """``python -m mpckpt.run`` for node ``node_rank`` of 2 on ``node``, its output in ``tmp/<label>.log``."""
    env = {**{k: v for k, v in os.environ.items() if k not in _DROPPED}, "PYTHONPATH": str(REPO),
           "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    cmd = [sys.executable, "-m", "mpckpt.run", "--nnodes", "2", "--node-rank", str(node_rank), "--nproc-per-node",
           "1", "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "2", "--spares", "0", WORKER, str(tmp / "root"),
           str(tmp / "out"), "--steps", str(STEPS), "--storage-every", "4", "--blob-mb", "4", "--peer-copies", "1",
           "--loss-wait-s", "60", "--step-sleep-s", "0.3"]
    with open(tmp / f"{label}.log", "ab") as out:
        return node.popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)


def logs(tmp: Path) -> str:
    return "\n".join(f"==== {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(tmp.glob("*.log")))


def wait_all(procs: list[subprocess.Popen], tmp: Path) -> None:
    for proc in procs:
        try:
            code = proc.wait(JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(f"a launcher did not end within {JOB_TIMEOUT_S} s; logs:\n{logs(tmp)}")
        assert code == 0, f"a launcher exited with {code}; logs:\n{logs(tmp)}"


def saved(out: Path, rank: int) -> list[int]:
    trace = out / f"rank{rank}" / "trace"
    lines = trace.read_text().split("\n") if trace.exists() else []
    return [int(line.split()[1]) for line in lines if line.startswith("saved ")]


def state(out: Path, rank: int, name: str) -> dict[str, Any]:
    return torch.load(out / f"rank{rank}" / f"{name}.pt")


def test_a_node_lost_a_fresh_node_joins_its_rank_restores_from_the_copy_the_survivor_heals_in_place(tmp_path):
    plain, lost = tmp_path / "plain", tmp_path / "lost"
    plain.mkdir(), lost.mkdir()
    with Cluster(2, shm_size="512m", name_prefix="hn") as cluster:
        port = free_port()
        wait_all([launch(cluster.nodes[i], i, port, plain, f"plain-{i}") for i in range(2)], plain)

        port = free_port()
        first = [launch(cluster.nodes[i], i, port, lost, f"first-{i}") for i in range(2)]
        wait_until(lambda: LOSE_AFTER in saved(lost / "out", 1), JOB_TIMEOUT_S, f"rank 1 saved step {LOSE_AFTER}",
                   poll_s=0.02)
        fresh = cluster.replace(1)  # node 1 lost: its launcher, its rank, its /dev/shm
        assert fresh.shm_listing() == []
        second = launch(fresh, 1, port, lost, "second-1")
        wait_all([first[0], second], lost)

    out = lost / "out"
    survivor = [json.loads(p.read_text()) for p in (out / "rank0").glob("proc-*.json")]
    assert len(survivor) == 1 and survivor[0]["heals"], survivor
    heal = survivor[0]["heals"][-1]
    step = heal["step"]
    assert heal["source"] == "memory" and step is not None, heal
    final0 = json.loads((out / "rank0" / "final.json").read_text())
    assert final0["pid"] == survivor[0]["pid"]
    ones = sorted((json.loads(p.read_text()) for p in (out / "rank1").glob("proc-*.json")),
                  key=lambda d: d["generation"])
    assert [d["generation"] for d in ones] == [0, 1], ones
    assert (ones[-1]["restored"], ones[-1]["source"]) == (step, "peer"), ones[-1]
    assert_same(state(out, 0, f"healed-{final0['pid']}"), state(out, 0, f"state-{step}"), "rank 0 healed")
    assert_same(state(out, 1, f"restored-{ones[-1]['pid']}"), state(out, 1, f"state-{step}"), "rank 1 restored")
    for rank in range(2):
        assert_same(state(out, rank, "final"), state(plain / "out", rank, "final"), f"rank {rank} final")
