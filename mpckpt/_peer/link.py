"""mpckpt's own channel between the ranks of a job: a gloo group and store connections of its own.

torch.distributed is the transport. The group is a ``ProcessGroupGloo`` built directly over
the job's store under a prefix private to this open of this root (``mpckpt-link/<token>/``: the
open's run token, fresh at every open and the same on every rank; nothing a process counts for
itself, since the ranks of one open need not have opened as many links before it: a survivor of
``mpckpt.heal`` reopens beside a replacement that opens for the first time): it is never registered as
a torch.distributed group, never one of the user's groups, and no collective runs on it: only
point-to-point sends and receives, from mpckpt's background threads (replication) and, during
a restore, from the training thread and a serving thread. gloo moves CPU tensors over TCP
whatever backend the user's group has (NCCL included), with its own I/O threads: the GIL is
not held while bytes move.

The control messages (an offer, its answer, the outcome) go through the store, each thread on
its own connection (``store()``, a clone): a thread waiting for the next offer never holds a
connection another thread needs, and waits there cost nothing on the network. Data goes over
gloo only once both sides have agreed, so every data operation is short and bounded by the
group's timeout.

A job whose group failed (``mpckpt.heal`` abandons the open) shuts the link's connections down
(``shut``: those its gloo group opened, as ``_links`` does for the process group): a transfer to
a rank lost with its node then fails at once instead of after ``PROGRESS_S``, and the threads of
the abandoned open stop within the abandon's bound.

Building the group is a collective moment (every rank of the job, same order): it happens at
open when ``peer_copies`` asks for replication, or at a restore that needs another node's
memory, both on the training thread of every rank.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch

from mpckpt import _links
from mpckpt._dist.group import RankGroup

CHUNK_BYTES = 32 << 20   # data moves in pieces this size (a superseded snapshot stops between two)
PROGRESS_S = 30.0        # the longest one piece may take: a peer that makes no progress is gone
_PROGRESS = datetime.timedelta(seconds=PROGRESS_S)


class Link:
    """The channel of one open root (``token``: what every rank of this open shares; one link per open)."""

    def __init__(self, group: RankGroup, token: str, *, timeout_s: float) -> None:
        import torch.distributed as dist

        self.rank, self.world_size = group.rank, group.world_size
        self.timeout_s = timeout_s
        self._store: Any = dist.PrefixStore(f"mpckpt-link/{token}/", group.store)
        self.pg: Any
        self.pg, self._connections = _links.opened_by(lambda: dist.ProcessGroupGloo(
            dist.PrefixStore("gloo/", self._store), group.rank, group.world_size, datetime.timedelta(seconds=timeout_s)))

    def shut(self) -> int:
        """Shut down the connections of the link's gloo group (the job's group failed): every
        transfer in flight or to come fails at once; how many. The store's connections stay."""
        shut = _links.shut(self._connections)
        self._connections = {}
        return shut

    def store(self) -> Any:
        """A store connection of the calling thread's own (the keys of this link)."""
        return self._store.clone()

    def send(self, data: torch.Tensor, dst: int, tag: int) -> None:
        """Send a contiguous tensor of at most ``CHUNK_BYTES`` (bounded by ``PROGRESS_S``: a lost
        machine closes no connection, its peer must notice by the lack of progress)."""
        self.pg.send([data], dst, tag).wait(_PROGRESS)

    def recv(self, into: torch.Tensor, src: int, tag: int, *, timeout_s: float | None = None) -> None:
        """Receive into a contiguous tensor of at most ``CHUNK_BYTES`` (bounded like ``send``, or by
        ``timeout_s``: an answer that may wait behind other ranks' requests)."""
        self.pg.recv([into], src, tag).wait(_PROGRESS if timeout_s is None else datetime.timedelta(seconds=timeout_s))

    def send_bytes(self, data: torch.Tensor, dst: int, tag: int) -> None:
        """A uint8 tensor in ``CHUNK_BYTES`` pieces (the receiver calls ``recv_bytes`` alike)."""
        for start in range(0, data.numel(), CHUNK_BYTES):
            self.send(data[start:start + CHUNK_BYTES], dst, tag)

    def recv_bytes(self, into: torch.Tensor, src: int, tag: int) -> None:
        for start in range(0, into.numel(), CHUNK_BYTES):
            self.recv(into[start:start + CHUNK_BYTES], src, tag)


def as_bytes(buffer: Any) -> torch.Tensor:
    """A uint8 tensor over a writable buffer (a memoryview, a bytearray, an mmap), no copy."""
    if len(memoryview(buffer)) == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(buffer, dtype=torch.uint8)


def ints(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)
