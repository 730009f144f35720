"""``harness.nodes``: simulated machines on this one, each with its own hostname and ``/dev/shm``.

- Two nodes: a file in one node's ``/dev/shm`` is seen neither on the other nor on the host; their
  hostnames differ.
- A 2-node x 1-proc torchrun job (gloo on loopback): every rank sees two hostnames and two ``/dev/shm``
  devices; every agent exits 0.
- ``lose()`` under a running job: no process is left in the node's mount namespace (agent, worker, the
  worker's child), a replacement node's ``/dev/shm`` is empty, the other node's file is still there; the
  surviving node's agent ends (its worker's receive from the lost rank fails in gloo); the cluster's exit
  leaves no process of any node.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from harness.nodes import Cluster, namespaces_unavailable
from tests.waiting import wait_until

if (_why := namespaces_unavailable()) is not None:
    pytest.skip(_why, allow_module_level=True)

PROBE = Path(__file__).with_name("nodes_probe.py")
JOB_TIMEOUT_S = 120


def test_nodes_have_their_own_shm_and_hostname() -> None:
    with Cluster(2, shm_size="16m", name_prefix="tn") as cluster:
        a, b = cluster.nodes
        a.shm_path("only-on-a").write_bytes(b"a")
        assert a.shm_listing() == ["only-on-a"]
        assert "only-on-a" not in b.shm_listing()
        assert not os.path.exists("/dev/shm/only-on-a")
        names = [n.popen(["hostname"], stdout=subprocess.PIPE).communicate(timeout=30)[0].decode().strip()
                 for n in cluster.nodes]
        assert names == ["tn0", "tn1"]
        assert os.stat(a.shm_path()).st_dev != os.stat(b.shm_path()).st_dev != os.stat("/dev/shm").st_dev
    assert not a.alive and not b.alive and a.pids() == [] and b.pids() == []


def test_two_node_job_sees_two_hosts(tmp_path: Path) -> None:
    with Cluster(2, shm_size="16m", name_prefix="tj") as cluster:
        start = time.monotonic()
        job = cluster.launch(PROBE, [tmp_path], nproc_per_node=1, log_dir=tmp_path / "logs")
        codes = job.wait(JOB_TIMEOUT_S)
        assert codes == [0, 0], job.logs()
        print(f"2-node launch took {time.monotonic() - start:.1f} s")
    for rank in range(2):
        seen = json.loads((tmp_path / f"probe-r{rank}.json").read_text())["seen"]
        assert sorted(h for h, _ in seen) == ["tj0", "tj1"]
        assert len({d for _, d in seen}) == 2


def test_lose_kills_every_process_and_memory_of_a_node(tmp_path: Path) -> None:
    with Cluster(2, shm_size="16m", name_prefix="tl") as cluster:
        job = cluster.launch(PROBE, [tmp_path, "--hold"], nproc_per_node=1, log_dir=tmp_path / "logs")
        wait_until(lambda: all((tmp_path / f"held-r{r}.json").exists() for r in range(2)), 60, "ranks holding",
                   poll_s=0.05)
        lost, kept = cluster.nodes
        held = json.loads((tmp_path / "held-r0.json").read_text())
        on_lost = {p: _started(p) for p in lost.pids()}  # a pid is a process only with its start time
        assert {held["pid"], held["child"], job.agents[0].pid} <= on_lost.keys()
        assert "probe-r0" in lost.shm_listing() and "probe-r1" in kept.shm_listing()

        lost.lose()
        assert not lost.alive and lost.pids() == []
        # the kernel takes them down after lose() killed the node's init: bounded, and a pid reused
        # meanwhile by another test's process is not one of them
        wait_until(lambda: not any(_started(p) == t and _state(p) != "Z" for p, t in on_lost.items()), 30,
                   "every process of the lost node gone")
        assert job.agents[0].poll() is not None  # reaped by lose()
        assert "probe-r1" in kept.shm_listing()

        fresh = cluster.replace(0)
        assert fresh.alive and fresh.name == "tl0" and fresh.shm_listing() == []
        start = time.monotonic()
        assert job.wait(JOB_TIMEOUT_S)[1] != 0, job.logs()  # its worker's gloo peer is gone
        print(f"the surviving agent ended {time.monotonic() - start:.1f} s after the loss")
    assert [n.pids() for n in cluster.nodes] == [[], []]  # the survivor's orphaned child went with the cluster


def _started(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except OSError:
        return "gone"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
