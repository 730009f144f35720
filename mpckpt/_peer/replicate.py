"""Copies of this rank's kept snapshots in other nodes' memory, and the copies it holds for others.

Sending (one ``mpckpt-peer-send`` thread): every kept snapshot is offered (``offer``); the job
copies in rounds (``rounds``): rank 0 opens round k with its newest step once every rank is done
with round k-1, and every rank sends its snapshot of that step to each target rank
(``node.Placement``), one after the other. Per target, over the link (``link``): the offer
(step, sizes) through the store; the receiver's answer (accepted, or refused: its budget is
full); then the record and the slab's bytes over gloo, in pieces, each preceded by a flag that
says whether the snapshot is still held; the receiver's verdict through the store. A newer
snapshot never overtakes the copy in flight: the keeper holds the snapshot being sent
(``pinned``), and the newest step copied for every rank, until a newer one is. An offer's future
resolves with the number of copies in place (0 for a snapshot no round copied).

Pacing: a copy sent at full speed takes a core (and on a real cluster the network) from
training in a burst. The sender spreads each copy over half the time between the last
snapshots kept, at most 10 s (its pieces are sent on schedule, the thread sleeps between
them), so the copy is done well before the next snapshot while training keeps most of the
machine, and a node lost meanwhile costs at most that long of exposure. Someone
waiting for it (the save's ``future.result()``, ``wait()``, ``close()``) makes it hurry: the
rest goes at full speed.

Receiving (one ``mpckpt-peer-recv`` thread per source rank): each copy is written into a new
file of this node's /dev/shm (``mpckpt-peer-`` names, ``_keep.store``), counted against this
rank's memory budget (``Arena.hold_external``; no room: refused, the sender warns, nothing is
allocated), verified (the record's own checksum, whose snapshot it is, the xxh3-64 of every
file) and only then published (its record renamed into place). A source's copies are held as
its own snapshots are (``_keep.agreement.to_hold``): the newest, and the newest step copied for
every rank, until a newer one is; older ones go, or before the new one when the budget cannot
hold both (with a warning). The budget always leaves room for the rank's own two slabs first
(``hold_external``). Every piece of data and every answer has a bounded wait
(``link.PROGRESS_S``): a lost machine closes no connection, so a peer that makes no progress
counts as gone. A copy that does not verify, or whose sender died or stopped mid-way, is
removed and never published.

Nothing here runs on the training thread but ``offer`` (a dict put). Copies outlive this
process (a restart on this node restores from them, ``inventory``); ``close(leave=False)``
(the run ended) removes them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import json
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from mpckpt._keep.agreement import to_hold
from mpckpt._keep.record import KeptRecord
from mpckpt._keep.store import PEER_PREFIX, KeptStore, data_path
from mpckpt._peer.link import CHUNK_BYTES, PROGRESS_S, Link, as_bytes, ints
from mpckpt._peer.rounds import Rounds
from mpckpt._stage.arena import Arena, Slab
from mpckpt._threads import Thread
from mpckpt.format.checksums import file_checksums

log = logging.getLogger("mpckpt")
_TAG = 7          # replication data, per (sender, receiver) pair: one transfer at a time
_IDLE = datetime.timedelta(hours=24)  # a receiver's wait for the next offer (close wakes it sooner)
_ANSWER_S = 30.0  # a live receiver answers an offer at once: longer means it is gone
_BYE = json.dumps({"bye": True})
_SPREAD_MAX_S = 10.0  # a copy is spread over at most this long: the time a node loss costs that step
_POLL_S = 1.0  # the sender's waits on the store, between looks at whether it is closing


@dataclasses.dataclass
class _Offered:
    record: KeptRecord
    slab: Slab
    future: concurrent.futures.Future[int]
    spread_s: float = 0.0   # the time to spread the copy over (0: full speed)
    hurry: bool = False

    @property
    def extent(self) -> int:
        """Bytes of the slab the snapshot's files occupy (from its start)."""
        return max((s.offset + s.nbytes for s in self.record.spans.values()), default=0)


def _key(src: int, dst: int, n: int, what: str) -> str:
    return f"rep/{src}-{dst}/{n}/{what}"


class Replicator:
    """This rank's side of the replication: sending to ``targets``, receiving from ``sources``.

    ``holds(record)``: whether the keeper still holds that kept snapshot (its slab unwritten)."""

    def __init__(self, link: Link, *, url: str, arena: Arena, targets: list[int], sources: list[int],
                 held: dict[int, KeptStore], held_bytes: dict[int, int], warn: Any,
                 holds: Any = None) -> None:
        self.link, self.url, self.arena = link, url, arena
        self.rank = link.rank
        self.targets, self.sources = targets, sources
        # source rank -> the store of its copies here (locks taken at open or at its first copy), and the
        # bytes of them counted in the budget: the tier's, which releases them at close
        self.held, self.held_bytes = held, held_bytes
        self.copies: dict[int, dict[int, KeptRecord]] = {}  # source rank -> step -> the copy's record
        self.warn = warn
        self.holds = holds if holds is not None else (lambda record: True)
        self.rounds = Rounds(link.store(), rank=self.rank, world_size=link.world_size)
        self.round = 0  # the round this rank's sender waits for or sends
        self._cond = threading.Condition()
        self._offered: dict[int, _Offered] = {}  # step -> a kept snapshot no round has copied yet
        self._sending: _Offered | None = None
        self._stopping = False
        self._sent = dict.fromkeys(targets, 0)
        self._received = dict.fromkeys(sources, 0)
        self._last_offer: float | None = None
        self._interval: float | None = None  # between snapshots kept, smoothed
        self._threads: list[threading.Thread] = []
        if targets:
            self._start(self._send_loop, "mpckpt-peer-send")
        for src in sources:
            self._start(self._recv_loop, f"mpckpt-peer-recv-{src}", src)

    def _start(self, target: Any, name: str, *args: Any) -> None:
        thread = Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    # -- sending ---------------------------------------------------------------------------------
    def offer(self, record: KeptRecord, slab: Slab) -> concurrent.futures.Future[int]:
        """Copy the snapshot kept in ``slab`` to the targets when a round copies its step; the
        future: copies in place (0 when no round copied it)."""
        future: concurrent.futures.Future[int] = concurrent.futures.Future()
        if not self.targets:
            future.set_result(0)
            return future
        now = time.monotonic()
        if self._last_offer is not None:
            gap = now - self._last_offer
            self._interval = gap if self._interval is None else 0.7 * self._interval + 0.3 * gap
        self._last_offer = now
        item = _Offered(record, slab, future, spread_s=min(0.5 * (self._interval or 0.0), _SPREAD_MAX_S))
        future.hurry = lambda: self._hurry(item)  # type: ignore[attr-defined]
        with self._cond:
            if self._stopping:
                future.set_result(0)
                return future
            for step, old in list(self._offered.items()):  # let go (never copied) what the keeper let go
                if not self.holds(old.record):
                    del self._offered[step]
                    old.future.set_result(0)
            self._offered[record.step] = item
            self._cond.notify_all()
        return future

    def pinned(self, held: list[int]) -> set[int]:
        """Of the steps this rank keeps (``held``), those its copies need held (``rounds.pinned``);
        read from the store now (the keeper's agreement thread, or a save that needs memory)."""
        if not self.targets:
            return set()
        sending = self._sending
        return self.rounds.pinned(self.round, held, sending.record.step if sending is not None else None)

    def _hurry(self, item: _Offered) -> None:
        with self._cond:
            item.hurry = True
            self._cond.notify_all()

    def _pace(self, item: _Offered, started: float, sent: int) -> None:
        """Sleep until ``sent`` bytes are due (spread over ``item.spread_s``), unless hurried."""
        if item.spread_s <= 0 or not item.extent:
            return
        due = started + item.spread_s * sent / item.extent
        with self._cond:
            while not item.hurry and not self._stopping:
                left = due - time.monotonic()
                if left <= 0:
                    return
                self._cond.wait(left)

    def _superseded(self, item: _Offered) -> bool:
        with self._cond:
            return self._stopping or not self.holds(item.record)

    def _next_round(self) -> int | None:
        """The step of round ``self.round``: rank 0 opens it (once every rank is done with the one
        before, with its newest step newer than that round's); the others wait for it. None: closing."""
        k, rounds = self.round, self.rounds
        if not rounds.leads:
            while not self._stopping:
                step = rounds.opened(k, _POLL_S)
                if step is not None:
                    return step
            return None
        while not self._stopping and not rounds.ended(k - 1, _POLL_S):
            pass
        last = rounds.known.get(k - 1, -1)
        with self._cond:
            while not self._stopping and not any(s > last for s in self._offered):
                self._cond.wait(_POLL_S)
            if self._stopping:
                return None
            step = max(self._offered)
        rounds.open(k, step)
        return step

    def _item_for(self, step: int) -> _Offered | None:
        """This rank's snapshot of ``step`` (waiting for its save when this rank is behind); None
        when it does not hold it (it saved a newer step without it, or let it go)."""
        with self._cond:
            while not self._stopping:
                item = self._offered.get(step)
                if item is not None:
                    return item if self.holds(item.record) else None
                if any(s > step for s in self._offered):
                    return None
                self._cond.wait(_POLL_S)
        return None

    def _send_loop(self) -> None:
        store = self.link.store()
        while True:
            try:
                step = self._next_round()
            except Exception as e:  # the job's store failed: try again, unless closing
                log.debug("mpckpt: waiting for round %d of the copies: %s", self.round, e)
                time.sleep(_POLL_S)
                continue
            if step is None:
                return
            item = self._item_for(step)
            if item is None and self._stopping:
                return
            copies = 0
            if item is not None:
                with self._cond:
                    self._sending = item
                for dst in self.targets:
                    try:
                        copies += self._send_to(store, dst, item)
                    except Exception as e:  # a dead peer, a broken link: that copy is missing, said once
                        self.warn(f"send-{dst}", f"the copy of step {step} to rank {dst} failed ({e}); until a "
                                  "copy gets there, losing this node means restoring from an older step or storage")
            try:
                self.rounds.finish(self.round, step, copied=item is not None and copies == len(self.targets))
            except Exception as e:  # the job's store is gone: so is the job
                log.debug("mpckpt: ending round %d of the copies: %s", self.round, e)
                return
            finally:
                with self._cond:
                    self._sending = None
                    for s in [s for s in self._offered if s <= step]:  # copied now, or never will be
                        done = self._offered.pop(s)
                        done.future.set_result(copies if done is item else 0)
                    self._cond.notify_all()
            self.round += 1

    def _send_to(self, store: Any, dst: int, item: _Offered) -> int:
        record, n = item.record, self._sent[dst]
        self._sent[dst] = n + 1
        body = record.to_bytes()
        offer = json.dumps({"step": record.step, "seq": record.seq, "record": len(body), "data": item.extent})
        if bytes(store.compare_set(_key(self.rank, dst, n, "offer"), "", offer)).decode() != offer:
            return 0  # the receiver is closing (its goodbye is there first)
        answer = _answer(store, _key(self.rank, dst, n, "answer"), dst, min(_ANSWER_S, self.link.timeout_s))
        if answer != "accept":
            if answer != "refused: closing":
                self.warn(f"refused-{dst}", f"rank {dst} holds no copy of step {record.step}: {answer}")
            return 0
        self.link.send_bytes(as_bytes(bytearray(body)), dst, _TAG)
        aborted = False
        started = time.monotonic()
        for start in range(0, item.extent, CHUNK_BYTES):
            self._pace(item, started, start)
            aborted = self._superseded(item)
            self.link.send(ints(0 if aborted else 1), dst, _TAG)
            if aborted:
                break
            self.link.send(item.slab.tensor[start:min(start + CHUNK_BYTES, item.extent)], dst, _TAG)
        # every byte is out: the receiver verifies and publishes on its own, so a closing sender
        # stops waiting for its verdict (one lost with its node gives none: abandon would wait)
        verdict = _answer(store, _key(self.rank, dst, n, "done"), None, PROGRESS_S + item.extent / 50e6,
                          stopping=lambda: self._stopping)
        for what in ("offer", "answer", "done"):
            store.delete_key(_key(self.rank, dst, n, what))
        if verdict == "ok":
            return 1
        if not aborted and not self._superseded(item):
            self.warn(f"bad-{dst}", f"rank {dst} refused the copy of step {record.step}: {verdict}")
        elif not self._stopping:
            self.warn("taken", f"the copy of step {record.step} to another node stopped: the memory budget took "
                      "its snapshot for a save (the next round copies a newer one). Raise memory_budget")
        return 0

    # -- receiving -------------------------------------------------------------------------------
    def _recv_loop(self, src: int) -> None:
        store = self.link.store()
        failures = 0
        while True:
            n = self._received[src]
            try:
                store.wait([_key(src, self.rank, n, "offer")], _IDLE)
                offer = json.loads(store.get(_key(src, self.rank, n, "offer")))
                failures = 0
            except Exception as e:  # the wait ran out (a day without a save), or the store is gone
                failures += 1
                if self._stopping or failures > 5:  # the job's store is gone: so is the job
                    return
                log.debug("mpckpt: waiting for a copy from rank %d: %s", src, e)
                time.sleep(1.0)
                continue
            if offer.get("bye"):
                return
            if self._stopping:
                store.set(_key(src, self.rank, n, "answer"), "refused: closing")
                return
            self._received[src] = n + 1
            verdict = "failed"
            try:
                verdict = self._receive(store, src, n, offer)
            except Exception as e:
                verdict = f"failed on rank {self.rank}: {type(e).__name__}: {str(e)[:300]}"
                log.warning("mpckpt: receiving the copy of step %s of rank %d: %s", offer.get("step"), src, verdict)
            finally:
                try:
                    store.set(_key(src, self.rank, n, "done"), verdict)
                except Exception as e:
                    log.debug("mpckpt: could not answer rank %d: %s", src, e)

    def _receive(self, store: Any, src: int, n: int, offer: dict[str, Any]) -> str:
        size, body_size = int(offer["data"]), int(offer["record"])
        why = self._room_for(src, size)
        if why:
            store.set(_key(src, self.rank, n, "answer"), f"refused: {why}")
            return "refused"
        keeper = self.held[src]
        name = keeper.new_data_name()
        fd = os.open(data_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        published = False
        try:
            if size:
                os.posix_fallocate(fd, 0, size)  # no room in /dev/shm: an error now, never a SIGBUS later
            store.set(_key(src, self.rank, n, "answer"), "accept")
            body = bytearray(body_size)
            self.link.recv_bytes(as_bytes(body), src, _TAG)
            with mmap.mmap(fd, max(size, 1)) as data:
                flag = ints(0)
                for start in range(0, size, CHUNK_BYTES):
                    self.link.recv(flag, src, _TAG)
                    if int(flag[0]) == 0:
                        return "stopped: its sender no longer holds the snapshot"
                    self.link.recv(as_bytes(data)[start:min(start + CHUNK_BYTES, size)], src, _TAG)
                record = KeptRecord.from_bytes(bytes(body), path=f"the copy of rank {src}'s snapshot")
                why = _wrong(record, self.url, src, size, data)
                if why:
                    return f"does not verify: {why}"
            record = dataclasses.replace(record, data=name, data_size=size)
            replaced = self.copies.get(src, {}).get(record.step)
            keeper.publish_record(record)  # (a copy of the same step it replaces goes)
            published = True
            if replaced is not None:
                self._uncount(src, replaced.data_size)
            self.copies.setdefault(src, {})[record.step] = record
            self.held_bytes[src] = self.held_bytes.get(src, 0) + size
            self._tidy(src)
            return "ok"
        finally:
            os.close(fd)
            if not published:
                self.arena.release_external(size)
                try:
                    os.unlink(data_path(name))
                except FileNotFoundError:
                    pass

    def adopt(self, src: int, record: KeptRecord) -> None:
        """A copy of ``src``'s found at open and restored (``tier.settle``): held from now on."""
        self.copies[src] = {record.step: record}

    def _drop(self, src: int, steps: set[int]) -> None:
        """Remove the copies of ``src``'s ``steps`` held here (record first, then data)."""
        mine = self.copies.get(src, {})
        for step in steps & set(mine):
            record = mine.pop(step)
            self.held[src].drop(record)
            self._uncount(src, record.data_size)

    def _uncount(self, src: int, nbytes: int) -> None:
        """``nbytes`` of ``src``'s copies no longer held here: out of the budget."""
        self.held_bytes[src] = max(0, self.held_bytes.get(src, 0) - nbytes)
        self.arena.release_external(nbytes)

    def _tidy(self, src: int) -> None:
        """Let the copies of ``src`` go that no longer need holding: the newest stays, and the
        newest step copied for every rank (``rounds``)."""
        steps = set(self.copies.get(src, {}))
        try:
            copied = self.rounds.refresh(steps)
        except Exception as e:  # the store is gone: hold what is here (the budget bounds it)
            log.debug("mpckpt: reading which steps are copied everywhere: %s", e)
            return
        self._drop(src, steps - to_hold(steps, copied))

    def _room_for(self, src: int, size: int) -> str:
        """Why a copy of ``size`` bytes from ``src`` cannot be held (its bytes counted if it can)."""
        if src not in self.held:
            store = KeptStore(self.url, src, PEER_PREFIX)
            if not store.hold(quiet=True):
                return f"another live process on rank {self.rank}'s node holds copies of rank {src}"
            self.held[src] = store
        if self.arena.hold_external(size):
            return ""
        older = set(self.copies.get(src, {}))
        if older:  # older copies give way to the newer one: the newest held first
            newest = max(older)
            self._drop(src, older - {newest})
            if self.arena.hold_external(size):
                return ""
            self._drop(src, {newest})
            self.warn("budget-copies", f"rank {self.rank} has no room in its memory budget for a copy of rank "
                      f"{src}'s snapshot beside the one it held; until this copy is in place, losing that rank's "
                      "node restores from storage. Raise memory_budget")
            if self.arena.hold_external(size):
                return ""
        budget = self.arena.budget_bytes
        self.warn("budget", f"rank {self.rank} has no room in its memory budget ({budget >> 20} MiB) for a copy of "
                  f"{size >> 20} MiB of rank {src}'s snapshot; raise memory_budget to about (3 + 2 x peer_copies) "
                  "times the state of a rank")
        return f"rank {self.rank}'s memory budget ({budget >> 20} MiB) has no room for {size >> 20} MiB"

    # -- waiting, closing ------------------------------------------------------------------------
    def wait(self, timeout_s: float) -> bool:
        """Until every snapshot offered is copied, or passed over by a round of a newer step
        (bounded, at full speed); whether that was reached."""
        with self._cond:
            for item in [*self._offered.values(), self._sending]:
                if item is not None:
                    item.hurry = True
            self._cond.notify_all()
            return self._cond.wait_for(lambda: not self._offered and self._sending is None, timeout_s)

    def close(self) -> None:
        """Stop the threads (bounded); a copy being received is finished first."""
        with self._cond:
            self._stopping = True
            if self._sending is not None:
                self._sending.hurry = True
            for step, item in list(self._offered.items()):
                if item is not self._sending:
                    del self._offered[step]
                    item.future.set_result(0)
            self._cond.notify_all()
        try:
            store = self.link.store()
            store.set(f"closed/{self.rank}", "1")  # senders waiting for an answer stop waiting
            for src in self.sources:  # wake our receivers: an offer that says goodbye (unless one came first)
                store.compare_set(_key(src, self.rank, self._received[src], "offer"), "", _BYE)
        except Exception as e:
            log.debug("mpckpt: could not wake the receivers: %s", e)
        for thread in self._threads:  # a copy being received is finished (each piece bounded: ``PROGRESS_S``)
            thread.join(timeout=PROGRESS_S)


def _answer(store: Any, key: str, dst: int | None, timeout_s: float, *,
            stopping: Callable[[], bool] = lambda: False) -> str:
    """The receiver's answer at ``key``; "refused: closing" once rank ``dst`` (if given) closed its
    receivers (a copy it accepted is finished before it closes), or once ``stopping()`` (this side closes)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if store.check([key]):
            return bytes(store.get(key)).decode(errors="replace")
        if (dst is not None and store.check([f"closed/{dst}"])) or stopping():
            return "refused: closing"
        if time.monotonic() > deadline:
            raise TimeoutError(f"no answer at {key} within {timeout_s:.0f} s")
        time.sleep(0.02)


def _wrong(record: KeptRecord, url: str, src: int, size: int, data: mmap.mmap) -> str:
    """Why a received copy is not rank ``src``'s snapshot of ``url`` whole: "" when it is."""
    if record.uid != os.geteuid() or record.root != url or record.rank != src:
        return f"it is rank {record.rank}'s of {record.root!r} (user {record.uid})"
    view = memoryview(data)
    try:
        for rel, span in record.spans.items():
            if span.offset + span.nbytes > size:
                return f"{rel} lies past the {size} bytes received"
            if file_checksums(span.header, view[span.offset:span.offset + span.nbytes], 0)[0] != span.checksum:
                return f"{rel} does not match its checksum"
    finally:
        view.release()
    return ""
