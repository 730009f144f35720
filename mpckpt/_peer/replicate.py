"""Copies of this rank's kept snapshot in other nodes' memory, and the copies it holds for others.

Sending (one ``mpckpt-peer-send`` thread): once a snapshot is kept (``offer``), its record
and bytes go to each target rank (``node.Placement``), one after the other. Per target, over
the link (``link``): the offer (step, sizes) through the store; the receiver's answer
(accepted, or refused: its budget is full); then the record and the slab's bytes over gloo, in
pieces, each preceded by a flag that says whether the snapshot is still the newest; the
receiver's verdict through the store. A newer snapshot kept meanwhile supersedes the one being
sent: its transfer stops at the next piece (the slab is about to be written again) and the
newer one goes next. The offer's future resolves with the number of copies in place.

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
file) and only then published (its record renamed into place). The previous copy of that
rank goes once the new one is in place, or before it when the budget cannot hold both (a copy
of an older step is of no use once its sender kept a newer one: no other rank keeps that
step). The budget always leaves room for the rank's own two slabs first (``hold_external``).
Every piece of data and every answer has a bounded wait (``link.PROGRESS_S``): a lost
machine closes no connection, so a peer that makes no progress counts as gone. A copy that does not verify, or whose sender died or
stopped mid-way, is removed and never published.

Nothing here runs on the training thread but ``offer`` (a queue put). Copies outlive this
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
from typing import Any

from mpckpt._keep.digest import hash_span
from mpckpt._keep.record import KeptRecord
from mpckpt._keep.store import PEER_PREFIX, KeptStore, data_path
from mpckpt._peer.link import CHUNK_BYTES, PROGRESS_S, Link, as_bytes, ints
from mpckpt._stage.arena import Arena, Slab

log = logging.getLogger("mpckpt")
_TAG = 7          # replication data, per (sender, receiver) pair: one transfer at a time
_IDLE = datetime.timedelta(hours=24)  # a receiver's wait for the next offer (close wakes it sooner)
_ANSWER_S = 30.0  # a live receiver answers an offer at once: longer means it is gone
_BYE = json.dumps({"bye": True})
_SPREAD_MAX_S = 10.0  # a copy is spread over at most this long: the time a node loss costs that step


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
    """This rank's side of the replication: sending to ``targets``, receiving from ``sources``."""

    def __init__(self, link: Link, *, url: str, arena: Arena, targets: list[int], sources: list[int],
                 held: dict[int, KeptStore], held_bytes: dict[int, int], warn: Any) -> None:
        self.link, self.url, self.arena = link, url, arena
        self.rank = link.rank
        self.targets, self.sources = targets, sources
        # source rank -> the store of its copy here (locks taken at open or at its first copy), and the
        # bytes of it counted in the budget: the tier's, which releases them at close
        self.held, self.held_bytes = held, held_bytes
        self.warn = warn
        self._cond = threading.Condition()
        self._pending: _Offered | None = None
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
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    # -- sending ---------------------------------------------------------------------------------
    def offer(self, record: KeptRecord, slab: Slab) -> concurrent.futures.Future[int]:
        """Copy the snapshot kept in ``slab`` to the targets; the future: copies in place."""
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
            if self._pending is not None:  # never started: the newer snapshot replaces it
                self._pending.future.set_result(0)
            self._pending = item
            self._cond.notify_all()
        return future

    def _hurry(self, item: _Offered) -> None:
        with self._cond:
            item.hurry = True
            self._cond.notify_all()

    def _pace(self, item: _Offered, started: float, sent: int) -> None:
        """Sleep until ``sent`` bytes are due (spread over ``item.spread_s``), unless hurried or overtaken."""
        if item.spread_s <= 0 or not item.extent:
            return
        due = started + item.spread_s * sent / item.extent
        with self._cond:
            while not item.hurry and self._pending is None and not self._stopping:
                left = due - time.monotonic()
                if left <= 0:
                    return
                self._cond.wait(left)

    def _superseded(self, item: _Offered) -> bool:
        with self._cond:
            return self._pending is not None or self._stopping or not item.slab.kept

    def _send_loop(self) -> None:
        store = self.link.store()
        while True:
            with self._cond:
                while self._pending is None and not self._stopping:
                    self._cond.wait()
                if self._stopping and self._pending is None:
                    return
                item, self._pending = self._pending, None
                assert item is not None
                self._sending = item
            copies = 0
            for dst in self.targets:
                try:
                    copies += self._send_to(store, dst, item)
                except Exception as e:  # a dead peer, a broken link: that copy is missing, said once
                    self.warn(f"send-{dst}", f"the copy of step {item.record.step} to rank {dst} failed ({e}); "
                              "until a copy gets there, losing this node means restoring from storage")
            with self._cond:
                self._sending = None
                self._cond.notify_all()
            item.future.set_result(copies)

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
        verdict = _answer(store, _key(self.rank, dst, n, "done"), None, PROGRESS_S + item.extent / 50e6)
        for what in ("offer", "answer", "done"):
            store.delete_key(_key(self.rank, dst, n, what))
        if verdict == "ok":
            return 1
        if not aborted and not self._superseded(item):
            self.warn(f"bad-{dst}", f"rank {dst} refused the copy of step {record.step}: {verdict}")
        else:
            self.warn("superseded", f"the copy of step {record.step} to another node was overtaken by a newer "
                      "snapshot before it got there (the newest is copied next): snapshots are kept faster than they "
                      "can be copied. Save less often, or wait for a save's future before the next save")
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
                        return "stopped: a newer snapshot overtook it"
                    self.link.recv(as_bytes(data)[start:min(start + CHUNK_BYTES, size)], src, _TAG)
                record = KeptRecord.from_bytes(bytes(body), path=f"the copy of rank {src}'s snapshot")
                why = _wrong(record, self.url, src, size, data)
                if why:
                    return f"does not verify: {why}"
            keeper.publish_record(dataclasses.replace(record, data=name, data_size=size))
            published = True
            old = self.held_bytes.get(src, 0)
            self.held_bytes[src] = size
            self.arena.release_external(old)
            return "ok"
        finally:
            os.close(fd)
            if not published:
                self.arena.release_external(size)
                try:
                    os.unlink(data_path(name))
                except FileNotFoundError:
                    pass

    def _room_for(self, src: int, size: int) -> str:
        """Why a copy of ``size`` bytes from ``src`` cannot be held (its bytes counted if it can)."""
        if src not in self.held:
            store = KeptStore(self.url, src, PEER_PREFIX)
            if not store.hold(quiet=True):
                return f"another live process on rank {self.rank}'s node holds copies of rank {src}"
            self.held[src] = store
        if self.arena.hold_external(size):
            return ""
        old = self.held_bytes.pop(src, 0)
        if old:  # the older copy gives way to the newer one
            self.held[src].discard()
            self.arena.release_external(old)
            if self.arena.hold_external(size):
                return ""
        budget = self.arena.budget_bytes
        self.warn("budget", f"rank {self.rank} has no room in its memory budget ({budget >> 20} MiB) for a copy of "
                  f"{size >> 20} MiB of rank {src}'s snapshot; raise memory_budget to about (2 + peer_copies) times "
                  "the state of a rank")
        return f"rank {self.rank}'s memory budget ({budget >> 20} MiB) has no room for {size >> 20} MiB"

    # -- waiting, closing ------------------------------------------------------------------------
    def wait(self, timeout_s: float) -> bool:
        """Until nothing is being sent or waits to be (bounded, at full speed); whether that was reached."""
        with self._cond:
            for item in (self._pending, self._sending):
                if item is not None:
                    item.hurry = True
            self._cond.notify_all()
            return self._cond.wait_for(lambda: self._pending is None and self._sending is None, timeout_s)

    def close(self) -> None:
        """Stop the threads (bounded); a copy being received is finished first."""
        with self._cond:
            self._stopping = True
            if self._sending is not None:
                self._sending.hurry = True
            if self._pending is not None:
                self._pending.future.set_result(0)
                self._pending = None
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


def _answer(store: Any, key: str, dst: int | None, timeout_s: float) -> str:
    """The receiver's answer at ``key``; "refused: closing" once rank ``dst`` (if given) closed its
    receivers (a copy it accepted is finished before it closes)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if store.check([key]):
            return bytes(store.get(key)).decode(errors="replace")
        if dst is not None and store.check([f"closed/{dst}"]):
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
            if hash_span(span.header, view[span.offset:span.offset + span.nbytes], 0)[0] != span.checksum:
                return f"{rel} does not match its checksum"
    finally:
        view.release()
    return ""
