"""What the ranks of a job hold in memory, and restoring from it: the ``memory`` and ``peer`` sources.

At a restore (a collective moment) every rank tells the others, in one all_gather, its node and
the snapshots it holds: its own kept ones (``_keep``: the newest, and the newest step every rank
held) and the copies of other ranks' snapshots it holds (``replicate``; found at open in this node's /dev/shm, left by the previous process of
this node). From that every rank computes the same ``Plan``: for each step, whether every
rank's snapshot of it is held somewhere (each rank's of one save: its holders agree on its
sequence number and files; a rank's numbers are its own ledger's, so ranks' may differ),
and for each reader which holder to read each rank's files from (itself; else a rank of its
node, read straight from /dev/shm; else a rank of another node, through the link:
``serve``). The job agrees on the newest step it can read whole from memory; storage's
steps stay the fallback. A rank whose own snapshot comes from a copy reports ``peer`` as its
source (``Checkpointer.last_restore``), else ``memory``.

After the restore, copies of any other step are removed: the job goes on from the step it
restored, and a copy of an abandoned step must never stand in for a later save of that step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from mpckpt._dist.group import RankGroup
from mpckpt._keep.record import KeptRecord, Span, state_manifest
from mpckpt._keep.source import MemorySource
from mpckpt._keep.store import PEER_PREFIX, PREFIX, Found, KeptStore, peer_ranks, read_kept
from mpckpt._peer.link import Link, as_bytes
from mpckpt._peer.serve import Server, read_remote, stop_servers
from mpckpt.format.manifest import FileEntry, Manifest

log = logging.getLogger("mpckpt")


@dataclass(frozen=True)
class Held:
    """One snapshot a rank holds, as the other ranks learn of it."""

    rank: int   # whose snapshot
    step: int
    seq: int
    own: bool   # the rank's own kept snapshot, or a copy held for it
    files: tuple[tuple[str, int, str], ...]  # (relpath, size, checksum), sorted
    created_unix: float = 0.0
    metrics: dict[str, Any] = field(default_factory=dict, compare=False)

    @classmethod
    def of(cls, record: KeptRecord, *, own: bool) -> Held:
        files = tuple(sorted((rel, e.size, e.checksum) for rel, e in record.file_entries().items()))
        return cls(record.rank, record.step, record.seq, own, files, record.created_unix, dict(record.metrics))

    @property
    def save(self) -> tuple[int, int, tuple[tuple[str, int, str], ...]]:
        return self.step, self.seq, self.files


@dataclass
class Plan:
    """Every rank's node and holdings (``held[r]``: what rank r holds), seen from rank ``me``.

    Linear in the holdings: they are indexed once by (whose, step); a reader on a node holding
    no copy of a part reads it from the same holder as every such reader (its own, else the
    lowest rank holding it), so which ranks serve is found per part, not per reader and part.
    """

    me: int
    nodes: list[str]
    held: list[list[Held]]
    _index: dict[tuple[int, int], list[tuple[int, Held]]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        for r, hs in enumerate(self.held):
            for h in hs:
                self._index.setdefault((h.rank, h.step), []).append((r, h))

    @property
    def world_size(self) -> int:
        return len(self.nodes)

    def holders(self, rank: int, step: int) -> list[tuple[int, Held]]:
        return self._index.get((rank, step), [])

    def complete(self) -> set[int]:
        """Steps whose every rank's snapshot is held somewhere, each of one save (its holders agree
        on its sequence number and files): else not from memory. The ranks' sequence numbers may
        differ: each is its own ledger's (a rank whose ``save`` raised an earlier failure took no
        number where the others did), never compared across ranks."""
        out = set()
        for step in {step for _, step in self._index}:
            saves = [{h.save for _, h in self.holders(q, step)} for q in range(self.world_size)]
            if all(len(s) == 1 for s in saves):
                out.add(step)
        return out

    def holder(self, rank: int, step: int, reader: int) -> tuple[int, Held]:
        """Where ``reader`` reads ``rank``'s snapshot of ``step``: the rank itself, its node, any."""
        there = self.holders(rank, step)
        return min(there, key=lambda rh: (rh[0] != reader, self.nodes[rh[0]] != self.nodes[reader],
                                          not rh[1].own, rh[0]))

    def remote(self, step: int) -> bool:
        """Whether some rank reads some snapshot of ``step`` from another node's memory."""
        return bool(self.servers(step))

    def servers(self, step: int) -> list[int]:
        """The ranks some reader of another node reads a part of ``step`` from."""
        every = set(self.nodes)
        out = set()
        for q in range(self.world_size):
            there = self.holders(q, step)
            if there and every - {self.nodes[r] for r, _ in there}:  # a node holding no copy of q's part
                out.add(min(there, key=lambda rh: (not rh[1].own, rh[0]))[0])
        return sorted(out)

    def manifest(self, step: int) -> Manifest:
        files: dict[str, FileEntry] = {}
        first = None
        for q in range(self.world_size):
            _, held = self.holder(q, step, self.me)
            first = first or held
            files.update({rel: FileEntry(size, checksum) for rel, size, checksum in held.files})
        assert first is not None
        return state_manifest(step, first.seq, files, metrics=first.metrics, created_unix=first.created_unix,
                              world_size=self.world_size)


class JobMemory:
    """A rank's view of the job's memory at a restore (see the module docstring)."""

    def __init__(self, keeper: Any, group: RankGroup, node: str, *, link: Any) -> None:
        self.keeper, self.group, self.node = keeper, group, node
        self.url, self.world_size = keeper.url, group.world_size
        self._link = link  # a Link, or a callable making one (a collective) when a restore needs it
        # copies found at open, by whose they are (each rank's oldest first)
        self.copies: dict[int, tuple[KeptStore, list[Found]]] = {}
        if keeper.store.held:
            for rank in peer_ranks(self.url):
                store = KeptStore(self.url, rank, PEER_PREFIX)
                if not store.hold(quiet=True):
                    continue
                found = read_kept(self.url, rank, self.world_size, PEER_PREFIX)
                store.tidy(found)
                if not found:
                    store.release(leave=False)
                    continue
                self.copies[rank] = (store, found)
        self.plan: Plan | None = None
        self._opened: list[Found] = []
        self._server: Server | None = None
        self._serving: list[int] = []

    @property
    def link(self) -> Link:
        if not isinstance(self._link, Link):
            self._link = self._link()
        return self._link

    def _mine(self) -> list[tuple[Held, Found]]:
        out = [(Held.of(f.record, own=True), f) for f in self.keeper.found]
        return out + [(Held.of(f.record, own=False), f) for _, found in self.copies.values() for f in found]

    def _held_at(self, step: int) -> dict[tuple[int, bool], Found]:
        """What this rank holds of ``step``: (whose, its own or a copy) -> the snapshot."""
        return {(h.rank, h.own): f for h, f in self._mine() if h.step == step}

    def steps(self) -> dict[int, Manifest]:
        """Steps the job can restore whole from memory (a collective: every rank, training thread)."""
        mine = self._mine()
        every = self.group.all_gather((self.node, [h for h, _ in mine]))
        plan = self.plan = Plan(self.group.rank, [n for n, _ in every], [list(h) for _, h in every])
        complete = plan.complete()
        if complete:
            newest = max(complete)
            if plan.remote(newest) and self._server is None:  # every rank computes this alike
                self._serving = plan.servers(newest)
                link = self.link
                if self.group.rank in self._serving:
                    self._server = Server(link, self._reader(newest))
        return {step: plan.manifest(step) for step in complete}

    def _reader(self, step: int) -> Any:
        """What this rank's server reads: file ``number`` of the plan's list of ``step``'s files."""
        assert self.plan is not None
        table = self._table(step)
        held = self._held_at(step)
        source = MemorySource(list(held.values()), self.plan.manifest(step))  # the files held here

        def read(number: int, offset: int, length: int) -> torch.Tensor:
            rank, rel = table[number]
            found = held.get((rank, True)) or held.get((rank, False))
            if found is None:
                raise KeyError(f"rank {rank}'s snapshot of step {step} is not held here")
            what = found.record.spans.get(rel)
            if isinstance(what, Span) and offset >= len(what.header) and offset + length <= what.size:
                start = what.offset + offset - len(what.header)  # data only: sent from the mapping itself
                return as_bytes(found.data)[start:start + length]
            out = bytearray(length)  # the header, a small file, or a range the source refuses
            source.read_into(rel, offset, memoryview(out))
            return torch.frombuffer(out, dtype=torch.uint8) if length else torch.empty(0, dtype=torch.uint8)
        return read

    def _table(self, step: int) -> list[tuple[int, str]]:
        """Every file of ``step`` by number, alike on every rank: (whose, relpath)."""
        assert self.plan is not None
        table: list[tuple[int, str]] = []
        for q in range(self.world_size):
            _, held = self.plan.holder(q, step, 0)
            table.extend((q, rel) for rel, _, _ in held.files)
        return table

    def source_for(self, manifest: Manifest) -> Any:
        """The source of checkpoint ``manifest`` from memory, when the job holds that save whole."""
        plan = self.plan
        if plan is None or manifest.step not in plan.complete():
            return None
        mine = plan.manifest(manifest.step)
        if manifest.seq != mine.seq and plan.holder(plan.me, manifest.step, plan.me)[1].seq >= 0:
            return None  # another save of that step
        if any(manifest.files.get(rel, entry).checksum != entry.checksum for rel, entry in mine.files.items()):
            return None
        return self._source(manifest)

    def _source(self, manifest: Manifest) -> Any:
        plan, step, me = self.plan, manifest.step, self.group.rank
        assert plan is not None
        local: list[Found] = []
        remote: dict[str, tuple[int, int]] = {}
        table = {entry: n for n, entry in enumerate(self._table(step))}
        held = self._held_at(step)
        for q in range(self.world_size):
            holder, h = plan.holder(q, step, me)
            if holder == me:
                local.append(held[(q, h.own)])
            elif plan.nodes[holder] == plan.nodes[me]:  # in this node's /dev/shm
                there = read_kept(self.url, q, self.world_size, PREFIX if h.own else PEER_PREFIX)
                self._opened.extend(there)
                found = next((f for f in there if f.record.step == step), None)
                if found is None:
                    return None
                local.append(found)
            else:
                remote.update({rel: (holder, table[(q, rel)]) for rel, _, _ in h.files})
        own_holder, own = plan.holder(me, step, me)
        kind = "memory" if own_holder == me and own.own else "peer"
        return JobSource(MemorySource(local, manifest), remote, self.link if remote else None, kind)

    def finish(self) -> None:
        """The restore is over on every rank: stop the servers (each rank sends one stop)."""
        if self._serving:
            try:
                stop_servers(self.link, self._serving)
            except Exception as e:
                log.warning("mpckpt: stopping the restore server of rank %d: %s", (self.group.rank - 1) %
                            self.world_size, e)
            self._serving = []
        if self._server is not None:
            self._server.thread.join(timeout=self.link.timeout_s)
            self._server = None
        for found in self._opened:
            found.close()
        self._opened = []

    def newest_held(self) -> int | None:
        """The newest step any rank held a part of at the restore (own or a copy)."""
        plan = self.plan
        return max((h.step for hs in plan.held for h in hs), default=None) if plan is not None else None

    def settle(self, restored: int | None) -> dict[int, tuple[KeptStore, KeptRecord]]:
        """After the restore: the copies of ``restored`` stay held (returned: store, record); others go."""
        newest = self.newest_held()
        if restored is not None and newest is not None and newest > restored and self.group.rank == 0:
            log.info("mpckpt: restored step %d; the newest step a rank held a part of in memory was %d, not held "
                     "whole (%d step(s) behind it)", restored, newest, newest - restored)
        self.finish()
        kept = {}
        for rank, (store, found) in self.copies.items():
            for f in found:
                f.close()
                if f.record.step == restored:
                    kept[rank] = (store, f.record)
                else:
                    store.drop(f.record)
            if rank not in kept:
                store.discard()
                store.release(leave=False)
        self.copies = {}
        return kept

    def abort(self) -> None:
        """The job's group failed: the link's transfers in flight fail at once (``Link.shut``),
        never made for this (a link not made yet stays unmade)."""
        if isinstance(self._link, Link):
            self._link.shut()

    def close(self, *, leave: bool) -> None:
        self.finish()
        for store, found in self.copies.values():
            for f in found:
                f.close()
            if not leave:
                store.discard()
            store.release(leave=leave)
        self.copies = {}


class JobSource:
    """Files of one step from memory: this node's (``local``) and other nodes' (``remote``:
    relpath -> (holding rank, file number)). ``kind``: ``memory`` or ``peer``."""

    def __init__(self, local: MemorySource, remote: dict[str, tuple[int, int]], link: Link | None,
                 kind: str) -> None:
        self.local, self.remote, self.link, self.kind = local, remote, link, kind
        self.name, self.manifest = local.name, local.manifest

    def location(self, relpath: str) -> str:
        if relpath in self.remote:
            return f"the memory of rank {self.remote[relpath][0]} ({relpath})"
        return self.local.location(relpath)

    def size(self, relpath: str) -> int:
        if relpath in self.remote:
            return self.manifest.files[relpath].size
        return self.local.size(relpath)

    def read_into(self, relpath: str, offset: int, out: memoryview) -> None:
        where = self.remote.get(relpath)
        if where is None:
            self.local.read_into(relpath, offset, out)
            return
        assert self.link is not None
        read_remote(self.link, where[0], where[1], offset, out)
