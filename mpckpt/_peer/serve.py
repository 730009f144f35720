"""Reading another node's memory during a restore: a server per holding rank, a client per reader.

A restore reads byte ranges (``_read``), and in a job a rank reads ranges of other ranks' files
(replicated leaves are written once, by one rank; resharding reads any rank's shards). When the
snapshot holding a file is in another node's memory, the reader asks the rank holding it: one
request (which rank's snapshot, which of its files, offset, length, the tag to answer on) to
that rank's server thread over the link, answered with a status and then the bytes, received
straight into the reader's buffer. Requests come from any rank (``recv_anysource``) and are
answered in order; a reader's threads each wait on their own tag.

Nothing received is trusted: the read side checks every byte against the manifest (the block
checksums of a multi-rank save) as it does for storage, so a damaged or wrong copy is a
checksum failure, never restored state.

The servers run only during a restore, which is a collective moment: every rank knows from the
plan (``inventory``) which ranks serve. They stop when every rank is done reading (after the
restore's last agreement): each rank sends one stop to the server of the rank before it.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable

import torch

from mpckpt._peer.link import CHUNK_BYTES, Link, as_bytes, ints
from mpckpt._threads import Thread
from mpckpt.errors import CheckpointNotFoundError

log = logging.getLogger("mpckpt")
_REQUEST = 11
_STOP, _READ = 0, 1
_tags = itertools.count(1000)  # answer tags of this process's requests (any two in flight differ)

Reader = Callable[[int, int, int], torch.Tensor]  # (file number, offset, length) -> bytes (uint8)


class Server:
    """Answers reads of the files this rank holds (``read``), until a stop comes."""

    def __init__(self, link: Link, read: Reader) -> None:
        self.link, self.read = link, read
        self.failure: BaseException | None = None
        self.thread = Thread(target=self._serve, name="mpckpt-peer-serve", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        request = ints(0, 0, 0, 0, 0, 0)
        try:
            while True:
                self.link.pg.recv_anysource([request], _REQUEST).wait()
                op, asker, number, offset, length, tag = (int(v) for v in request.tolist())
                if op == _STOP:
                    return
                try:
                    data = self.read(number, offset, length)
                except Exception as e:
                    log.warning("mpckpt: rank %d could not serve file %d [%d, +%d) to rank %d: %s", self.link.rank,
                                number, offset, length, asker, e)
                    self.link.send(ints(0), asker, tag)
                    continue
                self.link.send(ints(1), asker, tag)
                self.link.send(data, asker, tag)
        except BaseException as e:  # a dead asker, the link's timeout: readers see their own failure
            self.failure = e
            log.debug("mpckpt: the restore server of rank %d stopped: %s", self.link.rank, e)


def read_remote(link: Link, holder: int, number: int, offset: int, out: memoryview) -> None:
    """Read ``len(out)`` bytes at ``offset`` of file ``number`` held by rank ``holder`` into ``out``."""
    target = as_bytes(out)
    for start in range(0, len(out), CHUNK_BYTES):
        piece = target[start:start + CHUNK_BYTES]
        tag = next(_tags) % (1 << 30) + 1000
        link.send(ints(_READ, link.rank, number, offset + start, piece.numel(), tag), holder, _REQUEST)
        status = ints(0)
        link.recv(status, holder, tag, timeout_s=link.timeout_s)  # behind other ranks' requests
        if int(status[0]) != 1:
            raise CheckpointNotFoundError(f"rank {holder} could not read file {number} of the snapshot it holds")
        link.recv(piece, holder, tag)


def stop_servers(link: Link, serving: list[int]) -> None:
    """Every rank calls this once all are done reading: each server gets one stop, from the rank after it."""
    left = (link.rank - 1) % link.world_size
    if left in serving and left != link.rank:
        link.send(ints(_STOP, link.rank, 0, 0, 0, 0), left, _REQUEST)
