"""Which node a rank runs on, and which other nodes hold copies of its snapshot.

A node is the memory that dies with it: what a copy must not share with the snapshot it
protects. Its identity (``node_id``) is ``MPCKPT_NODE_ID`` when set (a launcher that knows
better, or a test), else the host name, the kernel's boot id (a rebooted or re-imaged machine
is a new node, whatever its name) and the device of /dev/shm (two containers or namespaces of
one host, each with its own /dev/shm tmpfs, are two nodes; two ranks that share a /dev/shm
are one). The launcher's node rank (``GROUP_RANK`` of torchrun) is not used: it names a slot
of the job, and a replacement machine takes over the slot of the one that was lost.

Placement (``Placement``): the nodes in the order of their lowest global rank, and on each
node its ranks in rank order (the local index). Copy ``k`` (1..R) of rank r (node n, local
index i) goes to the rank of local index i on node n+k, around the ring (index i modulo the
ranks of that node, when nodes run different numbers of ranks). Every node thus sends and
receives R copies per rank it runs: traffic per node does not grow with the job, and the
same local rank is the partner (with one GPU per local rank, matching devices and memory).
The ring rather than pairs (n XOR 1) works for any number of nodes, odd included, and gives
R copies on R distinct other nodes. A rank never holds a copy of a rank on its own node; with
fewer than R+1 nodes a rank gets as many copies as there are other nodes (a warning says so).
"""

from __future__ import annotations

import functools
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mpckpt._system.shm import SHM_DIR
from mpckpt.config import SETTING

NODE_ID_VARIABLE = SETTING["node_id"].env


def node_id(environ: Mapping[str, str] | None = None) -> str:
    """This process's node (see the module docstring)."""
    env = os.environ if environ is None else environ
    given = SETTING["node_id"].value(None, env)  # declared in config.SETTINGS
    if given:
        return given
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    try:
        shm = os.stat(SHM_DIR).st_dev
    except OSError:
        shm = 0
    return f"{socket.gethostname()}/{boot}/{shm}"


@dataclass(frozen=True)
class Placement:
    """Who holds copies of whose snapshot, from every rank's node (``nodes[rank]``)."""

    nodes: tuple[str, ...]
    copies: int

    @functools.cached_property
    def order(self) -> list[str]:
        """The distinct nodes, in the order of their lowest rank."""
        return list(dict.fromkeys(self.nodes))

    @functools.cached_property
    def _ranks(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for rank, node in enumerate(self.nodes):
            out.setdefault(node, []).append(rank)
        return out

    @functools.cached_property
    def _where(self) -> tuple[dict[str, int], list[int]]:
        """Each node's place in ``order``; each rank's index on its node."""
        local = [0] * len(self.nodes)
        for ranks in self._ranks.values():
            for i, rank in enumerate(ranks):
                local[rank] = i
        return {node: n for n, node in enumerate(self.order)}, local

    def ranks_on(self, node: str) -> list[int]:
        return self._ranks.get(node, [])

    @property
    def effective_copies(self) -> int:
        return min(self.copies, len(self.order) - 1)

    def targets(self, rank: int) -> list[int]:
        """The ranks that hold copies of ``rank``'s snapshot, copy 1 first."""
        place, local = self._where
        n, index = place[self.nodes[rank]], local[rank]
        out = []
        for k in range(1, self.effective_copies + 1):
            there = self.ranks_on(self.order[(n + k) % len(self.order)])
            out.append(there[index % len(there)])
        return out

    def sources(self, rank: int) -> list[int]:
        """The ranks whose snapshots ``rank`` holds copies of (those of the ``copies`` nodes before its own)."""
        place, _ = self._where
        n = place[self.nodes[rank]]
        out: list[int] = []
        for k in range(1, self.effective_copies + 1):
            out.extend(r for r in self.ranks_on(self.order[(n - k) % len(self.order)]) if rank in self.targets(r))
        return sorted(out)


def placement(nodes: Sequence[str], copies: int) -> Placement:
    return Placement(tuple(nodes), copies)
