"""The recovery tier of one rank of a job, wired together: its memory, the job's, and the copies.

What the runtime of a multi-rank writer holds when snapshots are kept in memory: the job's
memory at a restore (``inventory.JobMemory``), and with ``peer_copies`` the replication of
each kept snapshot to other nodes (``replicate.Replicator``) over mpckpt's own link
(``link``), placed by ``node.Placement``. Opening it is one collective on the training thread
(every rank's node and ``peer_copies``: a rank that asks for another number of copies than
rank 0 is a ``ConfigError`` on every rank, never a hang).
"""

from __future__ import annotations

import logging
from typing import Any

from mpckpt._dist.group import RankGroup
from mpckpt._keep.agreement import JobAgreement
from mpckpt._keep.keeper import Keeper
from mpckpt._keep.store import KeptStore
from mpckpt._peer.inventory import JobMemory
from mpckpt._peer.link import Link
from mpckpt._peer.node import NODE_ID_VARIABLE, Placement, node_id
from mpckpt._peer.replicate import Replicator
from mpckpt._stage.arena import Arena
from mpckpt.errors import ConfigError
from mpckpt.format.manifest import Manifest

log = logging.getLogger("mpckpt")


class JobTier:
    """See the module docstring. ``token``: what every rank of this open shares."""

    def __init__(self, keeper: Keeper, arena: Arena, group: RankGroup, *, copies: int, token: str,
                 timeout_s: float) -> None:
        self.keeper, self.arena = keeper, arena
        self.node = node_id()
        every = group.all_gather((self.node, copies))
        if any(c != every[0][1] for _, c in every):
            raise ConfigError(f"peer_copies differs between ranks ({sorted({c for _, c in every})}); give every rank "
                              "the same (MPCKPT_PEER_COPIES)")
        # a kept snapshot is let go once a newer step is kept by every rank (``_keep.agreement``)
        keeper.join(JobAgreement(group.scoped(f"mpckpt/{token}/keep/"), rank=group.rank,
                                 world_size=group.world_size))
        self._make_link = lambda: Link(group, token, timeout_s=timeout_s)
        link: Any = self._make_link() if copies else self._make_link
        self.memory = JobMemory(keeper, group, self.node, link=link)
        # copies found at open serve the restore whatever the budget; it counts those kept after it
        self.held: dict[int, KeptStore] = {rank: store for rank, (store, _) in self.memory.copies.items()}
        self.sizes: dict[int, int] = {}
        self.replicator: Replicator | None = None
        placement = Placement(tuple(n for n, _ in every), copies)
        if copies:
            if placement.effective_copies < copies:
                log.warning("mpckpt: peer_copies=%d, but the job runs on %d node(s): each snapshot gets %d copies (%s "
                            "tells nodes apart)", copies, len(placement.order), placement.effective_copies,
                            f"{NODE_ID_VARIABLE}, else host name, boot id and /dev/shm")
            self.replicator = Replicator(self.memory.link, url=keeper.url, arena=arena,
                                         targets=placement.targets(group.rank), sources=placement.sources(group.rank),
                                         held=self.held, held_bytes=self.sizes, warn=keeper.warn_once,
                                         holds=keeper.holds)
            keeper.replicate = self.replicator.offer
            keeper.pinned = self.replicator.pinned

    # -- restoring -------------------------------------------------------------------------------
    def in_memory(self) -> dict[int, Manifest]:
        return self.memory.steps()

    def source_for(self, manifest: Manifest) -> Any:
        return self.memory.source_for(manifest)

    def done_reading(self) -> None:
        self.memory.finish()

    def settle(self, restored: int | None) -> None:
        """After a restore: copies of another step than ``restored`` go (see ``inventory``)."""
        kept = self.memory.settle(restored)
        for rank in list(self.held):
            if rank not in kept:  # removed by ``settle``
                self.held.pop(rank)
                self.arena.release_external(self.sizes.pop(rank, 0))
            elif rank not in self.sizes:  # found at open: counted in this rank's budget from now on
                store, record = kept[rank]
                size = record.data_size
                if self.arena.hold_external(size):
                    self.sizes[rank] = size
                    if self.replicator is not None:
                        self.replicator.adopt(rank, record)
                else:
                    log.warning("mpckpt: the copy of rank %d's snapshot does not fit this rank's memory budget "
                                "after the restore; it is removed (raise memory_budget)", rank)
                    self.held.pop(rank)
                    store.discard()
                    store.release(leave=False)

    # -- saving, closing -------------------------------------------------------------------------
    def wait(self, timeout_s: float) -> None:
        if self.replicator is not None and not self.replicator.wait(timeout_s):
            log.warning("mpckpt: copies to other nodes still in flight after %.0f s", timeout_s)

    def close(self, *, leave: bool, abort: bool = False) -> None:
        """Stop the copies and the restore's servers (``leave``: the copies held here stay for the
        next process). ``abort``: the job's group failed: the link's connections are shut first, so
        that a transfer to a lost rank fails at once instead of holding the close (``Link.shut``)."""
        self.keeper.replicate = self.keeper.pinned = None
        if abort:
            self.memory.abort()
        self.memory.close(leave=leave)
        if self.replicator is not None:
            self.replicator.close()
        for rank, store in self.held.items():  # unless ``leave``, the copies held here go
            if not leave:
                store.discard()
            store.release(leave=leave)
            self.arena.release_external(self.sizes.pop(rank, 0))
        self.held.clear()
