"""Simulated machines ("nodes") on this one machine, for tests and benchmarks of what survives a node loss.

A node is a private mount namespace plus a UTS namespace, held open by a long-lived holder process
(``unshare -m -u --propagation private --fork sh -c 'mount -t tmpfs ... /dev/shm && hostname NAME &&
exec sleep infinity'``): it has its own hostname and its own ``/dev/shm`` tmpfs (another ``st_dev``),
and shares the network (127.0.0.1) and the filesystems with the host and the other nodes (its mount table is
a private copy made at its start: mounts made on the host later are not seen on it).
Processes run on it through ``nsenter -t HOLDER -m -u``; every process they start stays in its mount
namespace, which is how :meth:`Node.lose` finds them all (torchrun agents, workers, uploaders).

The model: a node loss = every process of that node and its ``/dev/shm`` (the tmpfs goes with the
namespace); the job is then relaunched on the surviving nodes and a fresh one, as a scheduler would
(:meth:`Cluster.replace`, then :meth:`Cluster.launch` again). With torchrun's static rendezvous the
loss of one node's agent makes the other nodes' workers fail too (gloo errors): that first job is
expected to end badly. Needs root (:func:`namespaces_unavailable` says why not, for ``pytest.skip``).

This module owns the nodes' holder processes, the torchrun agents it launches and their log files;
:class:`Cluster`'s exit loses every node, leaving no process or mount behind. A holder also dies with the
thread that started it (``PR_SET_PDEATHSIG``), so a test process killed outright leaks no node; start
nodes from a thread that outlives them.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from harness.servers import free_port

REPO = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 30.0
LOSE_TIMEOUT_S = 30.0
_PR_SET_PDEATHSIG = 1
_DROPPED_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "MPCKPT_NODE_ID")


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the thread that started it ends (a crashed test leaks nothing)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


@functools.cache
def namespaces_unavailable() -> str | None:
    """None when nodes can be simulated here, else why not (a reason for ``pytest.skip``)."""
    if sys.platform != "linux":
        return f"simulated nodes need Linux namespaces (this is {sys.platform})"
    if os.geteuid() != 0:
        return "simulated nodes need root (mount and UTS namespaces, a tmpfs mount)"
    for tool in ("unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"simulated nodes need util-linux's {tool}, which is not on PATH"
    probe = subprocess.run(["unshare", "-m", "-u", "--propagation", "private", "--fork", "sh", "-c",
                            "mount -t tmpfs -o size=1m tmpfs /dev/shm && hostname mpckpt-probe"],
                           capture_output=True, text=True, timeout=START_TIMEOUT_S)
    if probe.returncode != 0:
        return f"unshare refused a private mount + UTS namespace with a tmpfs: {probe.stderr.strip()}"
    return None


def _mnt_ns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:  # gone, or a zombie (its namespaces are released at exit)
        return None


def _poll(cond: Callable[[], bool], deadline: float, what: str) -> None:
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} (given {LOSE_TIMEOUT_S:.0f} s)")
        time.sleep(0.01)


def _signal(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _kill_tree(root: int) -> None:
    """SIGKILL ``root`` and its descendants, all stopped first (a stopped process neither forks nor exits,
    which would reparent its children out of sight) until the tree is the same twice."""
    tree: set[int] = set()
    deadline = time.monotonic() + LOSE_TIMEOUT_S
    while time.monotonic() < deadline:
        parents, found = {}, {root}
        for p in filter(str.isdigit, os.listdir("/proc")):
            try:
                parents[int(p)] = int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
        while more := {p for p, pp in parents.items() if pp in found} - found:
            found |= more
        if found == tree:
            break
        tree = found
        _signal(tree, signal.SIGSTOP)
    _signal(tree, signal.SIGKILL)


class Node:
    """One simulated machine: a hostname and a ``/dev/shm`` of its own, its processes in its mount namespace."""

    def __init__(self, name: str, shm_size: str = "4g") -> None:
        self.name, self.shm_size = name, shm_size
        self._holder: subprocess.Popen | None = None
        self._ns: str | None = None
        self._children: list[subprocess.Popen] = []  # started here: reaped by lose()

    @property
    def pid(self) -> int:
        if self._holder is None:
            raise RuntimeError(f"node {self.name} is not started")
        return self._holder.pid

    @property
    def alive(self) -> bool:
        return self._holder is not None and self._holder.poll() is None and _mnt_ns(self.pid) == self._ns

    def start(self) -> Node:
        if self._holder is not None:
            raise RuntimeError(f"node {self.name} was started already")
        script = f"mount -t tmpfs -o size={self.shm_size} tmpfs /dev/shm && hostname {self.name} && echo ready " \
                 "&& exec sleep infinity"
        holder = subprocess.Popen(["unshare", "-m", "-u", "--propagation", "private", "--fork", "--kill-child",
                                   "sh", "-c", script], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent)
        self._holder = holder
        assert holder.stdout is not None
        ready, _, _ = select.select([holder.stdout], [], [], START_TIMEOUT_S)
        line = holder.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            holder.kill()
            rest = holder.communicate(timeout=START_TIMEOUT_S)[0]
            self._holder = None
            raise RuntimeError(f"node {self.name} did not start: {(line + rest).decode(errors='replace').strip()}")
        holder.stdout.close()
        self._ns = _mnt_ns(holder.pid)
        return self

    def __enter__(self) -> Node:
        return self if self._holder is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.lose()

    def popen(self, argv: Sequence[str], *, env: dict[str, str] | None = None, cwd: str | Path = REPO,
              stdout: Any = None, stderr: Any = None, stdin: Any = subprocess.DEVNULL) -> subprocess.Popen:
        """``argv`` run on this node (its own session, so that a group kill reaches what it starts)."""
        if not self.alive:
            raise RuntimeError(f"node {self.name} is not alive")
        proc = subprocess.Popen(["nsenter", "-t", str(self.pid), "-m", "-u", f"--wd={cwd}", "--", *argv], env=env,
                                stdin=stdin, stdout=stdout, stderr=stderr, start_new_session=True)
        self._children.append(proc)
        return proc

    def pids(self) -> list[int]:
        """Every live process of this node (those in its mount namespace)."""
        if self._ns is None:
            return []
        return [int(p) for p in os.listdir("/proc") if p.isdigit() and _mnt_ns(int(p)) == self._ns]

    def shm_path(self, name: str = "") -> Path:
        """A path, as seen from outside, into this node's ``/dev/shm``."""
        return Path(f"/proc/{self.pid}/root/dev/shm") / name

    def shm_listing(self) -> list[str]:
        return sorted(os.listdir(self.shm_path()))

    def lose(self) -> None:
        """SIGKILL every process of the node, then its holder; its ``/dev/shm`` goes with the namespace."""
        if self._holder is None:
            return
        deadline = time.monotonic() + LOSE_TIMEOUT_S

        def none_left_but_holder() -> bool:  # killed again until none is left: one may fork meanwhile
            left = [p for p in self.pids() if p != self.pid]
            _signal(left, signal.SIGKILL)
            return not left

        _poll(none_left_but_holder, deadline, f"node {self.name}: processes outlived SIGKILL")
        for proc in [*self._children, self._holder]:  # --kill-child: the holder's sleep goes with it
            proc.kill()
            proc.wait(max(0.1, deadline - time.monotonic()))  # reaped: no zombie of ours left
        _poll(lambda: not self.pids(), deadline, f"node {self.name}: processes outlived its holder")
        self._holder, self._ns, self._children = None, None, []


class Job:
    """One torchrun agent per node, launched by :meth:`Cluster.launch`."""

    def __init__(self, cluster: Cluster, agents: list[subprocess.Popen], logs: list[Path]) -> None:
        self.cluster, self.agents, self.log_paths = cluster, agents, logs  # node by node

    def logs(self, tail: int | None = None) -> str:
        parts = []
        for log in self.log_paths:
            text = log.read_text(errors="replace") if log.exists() else "(no log)"
            parts.append(f"==== {log}\n{text[-tail:] if tail else text}")
        return "\n".join(parts)

    def wait(self, timeout: float) -> list[int]:
        """The agents' exit codes, node by node; past ``timeout`` the agents are killed and TimeoutError raised."""
        deadline = time.monotonic() + timeout
        try:
            return [a.wait(max(0.0, deadline - time.monotonic())) for a in self.agents]
        except subprocess.TimeoutExpired:
            self.kill()
            raise TimeoutError(f"job did not end within {timeout:.0f} s; logs end:\n{self.logs(tail=3000)}") from None

    def kill(self) -> None:
        """SIGKILL every agent and all it started (torchrun starts workers in sessions of their own), then reap."""
        for agent in self.agents:
            if agent.poll() is None:
                _kill_tree(agent.pid)
        for agent in self.agents:
            agent.wait(LOSE_TIMEOUT_S)

    def kill_node(self, i: int) -> None:
        self.cluster.nodes[i].lose()


class Cluster:
    """``n_nodes`` nodes named ``<name_prefix>0`` ..., started on entry and all lost on exit."""

    def __init__(self, n_nodes: int, shm_size: str = "4g", name_prefix: str = "node") -> None:
        self.nodes = [Node(f"{name_prefix}{i}", shm_size) for i in range(n_nodes)]
        self._launches = 0

    def __enter__(self) -> Cluster:
        try:
            for node in self.nodes:
                node.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Every node lost (each one even when losing another raised)."""
        with contextlib.ExitStack() as stack:
            for node in self.nodes:
                stack.callback(node.lose)

    def replace(self, i: int) -> Node:
        """Node ``i`` lost (if alive) and a fresh one, same name, empty ``/dev/shm``, in its place."""
        old = self.nodes[i]
        old.lose()
        self.nodes[i] = Node(old.name, old.shm_size).start()
        return self.nodes[i]

    def launch(self, script: str | Path, args: Sequence[Any] = (), nproc_per_node: int = 1, *,
               env: dict[str, str] | None = None, log_dir: str | Path | None = None,
               master_port: int | None = None) -> Job:
        """``torchrun ... script *args`` on every node (static rendezvous on 127.0.0.1, no restarts).

        The workers' environment: this process's without torchrun's variables nor ``MPCKPT_NODE_ID``,
        plus ``PYTHONPATH`` = the repository, ``OMP_NUM_THREADS=1``, ``GLOO_SOCKET_IFNAME=lo`` (the nodes'
        hostnames resolve nowhere), then ``env``. Each agent's output goes to ``log_dir/launch<k>-<node>.log``.
        """
        base = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENV}
        full_env = {**base, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", **(env or {})}
        logs = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="mpckpt-nodes-"))
        logs.mkdir(parents=True, exist_ok=True)
        port = master_port or free_port()
        self._launches += 1
        agents, paths = [], []
        for i, node in enumerate(self.nodes):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(self.nodes)), "--node-rank",
                   str(i), "--nproc-per-node", str(nproc_per_node), "--rdzv-backend", "static", "--master-addr",
                   "127.0.0.1", "--master-port", str(port), "--max-restarts", "0", str(script), *map(str, args)]
            path = logs / f"launch{self._launches}-{node.name}.log"
            with open(path, "ab") as out:
                agents.append(node.popen(cmd, env=full_env, stdout=out, stderr=subprocess.STDOUT))
            paths.append(path)
        return Job(self, agents, paths)


__all__ = ["Cluster", "Job", "Node", "namespaces_unavailable"]
