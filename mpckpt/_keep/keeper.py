"""What one writer keeps in this node's memory: its newest complete snapshots, and the ones it found.

``keep`` runs once a snapshot's copy into its slab is complete (an eager save before it
returns, an overlapped one in its background copy): it publishes the record (``store``) and
marks the slab kept in the arena: no save copies into it while it is held. A single process
then lets its previous kept slab go back to the pool (once its own uploads are done); a rank
of a job holds it until a newer step is kept by every rank (``agreement``: the newest step every
rank holds survives any single failure). An ASYNC save is thus recoverable on this node as soon
as ``save()`` returns, before its upload, and a ``mode="memory"`` save is never uploaded at all.

The record lists every shard file's xxh3-64 (the checksum storage will also get, and in a
multi-rank save its block checksums: ``digest``). A rank's copy hashes each piece as it lands
and its record is published with them. A single process's eager save does not wait for them:
its record is published ``pending``, and completed once the save's uploads of the slab are
done: they hash every file they write (the manifest's checksums), and those are taken; only
the files no upload wrote (reused frozen shards, failed uploads, a ``mode="memory"`` save) are
hashed here, on two threads of the completer's (``_complete_when``, ``_complete_later``). The
record is then published again with every checksum (``wait`` waits for it). Hashing the whole
slab again right after the save took ~45 ms of CPU per GiB beside the first training step. A
process killed in between leaves the pending record, completed from the slab when it is found.

At open, the snapshots a previous process of this root and rank kept are found (``found``) and
offered to the restore as ``memory`` sources (``source_for``; in a job, ``_peer.inventory``
offers every rank's, wherever they are held). After the restore (``settle``) the restored one's
slab is taken over: it stays kept when that step is only in memory; when the step is on storage
its record goes and the slab serves the next save (no fresh pages). Snapshots found and not
restored are stale and removed.

Kept slabs count against the memory budget. When a save needs the memory of a kept slab and
nothing else is free, the arena asks which to give up (``_reclaim``): one no longer held (a newer
step is agreed meanwhile) silently, else the oldest with a warning; its record goes first, so
nothing ever reads a slab being written.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from mpckpt._keep.agreement import JobAgreement, to_hold
from mpckpt._keep.digest import with_checksums
from mpckpt._keep.record import UNKNOWN, KeptRecord, Span
from mpckpt._keep.source import MemorySource
from mpckpt._keep.store import Found, KeptStore, data_path, read_kept
from mpckpt._stage.arena import Arena, Slab
from mpckpt._system.shm import Segment
from mpckpt._threads import executor
from mpckpt.format.checksums import FileHasher, file_checksums
from mpckpt.format.manifest import Manifest, _json_safe_metrics

log = logging.getLogger("mpckpt")


class Keeper:
    """The kept snapshots of one writer (one rank of a job), and the ones found at open."""

    def __init__(self, url: str, arena: Arena, *, enabled: bool, rank: int = 0, world_size: int = 1) -> None:
        self.url, self.arena, self.enabled = url, arena, enabled
        self.rank, self.world_size = rank, world_size
        self.store = KeptStore(url, rank)
        self.found: list[Found] = []  # oldest first
        # the job's copies on other nodes (``_peer``): called with each record kept and its slab
        self.replicate: Callable[[KeptRecord, Slab], concurrent.futures.Future[int]] | None = None
        # a job's: the counters of kept steps (``agreement``; wired by ``_peer.tier``), and the steps
        # its copies to other nodes need held (``_peer.replicate``)
        self.agreement: JobAgreement | None = None
        self.pinned: Callable[[list[int]], set[int]] | None = None
        self._kept: list[tuple[Slab, KeptRecord]] = []  # oldest first
        # what the holding rule was last told (read together, off the training thread)
        self._agreed: set[int] = set()
        self._pins: set[int] = set()
        self._lock = threading.Lock()
        # threads started now, not inside a save (``running_threads``)
        self.pool = running_threads(2, "mpckpt-keep-copy")  # copies (and a rank's hashes) of a save
        self.completer = running_threads(2, "mpckpt-keep-complete")  # the checksums of a pending record
        self._completion: concurrent.futures.Future[None] | None = None
        self._agreeing: concurrent.futures.ThreadPoolExecutor | None = None  # a job's: ``_agree``, in order
        self._reading: MemorySource | None = None  # the source a restore reads a found snapshot through
        self._warned: set[str] = set()
        if self.store.hold():
            self.found = read_kept(url, rank, world_size)
            self.store.tidy(self.found)  # a torn publish, records that did not check, data no record lists
        arena.reclaim = self._reclaim

    @property
    def kept(self) -> tuple[Slab, KeptRecord] | None:
        """The newest kept snapshot: its slab and record."""
        kept = self._kept
        return kept[-1] if kept else None

    def held_steps(self) -> list[int]:
        """The steps of the snapshots kept now, oldest first."""
        with self._lock:
            return [r.step for _, r in self._kept]

    def join(self, agreement: JobAgreement) -> None:
        """Hold snapshots as a rank of a job (``agreement``): its thread starts now."""
        self.agreement = agreement
        self._agreeing = running_threads(1, "mpckpt-keep-agree")

    # -- the found snapshot: restoring from it ----------------------------------------------------
    def in_memory(self) -> dict[int, Manifest]:
        """The steps found in memory, as their manifests (a single process's: a job asks ``_peer``)."""
        return {found.record.step: found.record.manifest() for found in self.found}

    def source_for(self, manifest: Manifest) -> MemorySource | None:
        """The memory source of checkpoint ``manifest`` when a snapshot found at open is it."""
        found = next((f for f in self.found if f.record.step == manifest.step), None)
        if found is None:
            return None
        mine = found.record.manifest()
        if manifest.seq != mine.seq and found.record.seq >= 0:
            return None  # another save of that step (storage's is not the one kept)
        if any(entry.checksum != UNKNOWN and manifest.files.get(rel, entry).checksum != entry.checksum
               for rel, entry in mine.files.items()):
            return None
        self._reading = MemorySource([found], manifest)  # (what a pending record's restore learns: ``settle``)
        return self._reading

    def settle(self, restored: int | None, durable: set[int]) -> None:
        """After a restore (``restored``: its step; ``durable``: the steps on storage): take over
        the slab of the found snapshot that was restored (a pending record completed with the
        checksums the restore computed); the others are removed."""
        found, self.found = self.found, []
        reading, self._reading = self._reading, None
        record = None
        for f in found:
            f.close()
            if f.record.step == restored and self.store.held:
                record = f.record
            else:
                self.store.drop(f.record)
        if record is None:
            return
        try:
            segment = Segment.adopt(data_path(record.data), record.data_size)
        except OSError as e:
            log.warning("mpckpt: could not take over the snapshot kept in memory (%s); it is removed", e)
            self.store.drop(record)
            return
        on_storage = record.step in durable
        slab = self.arena.adopt(segment, kept=self.enabled and not on_storage)
        if slab is None or on_storage or not self.enabled:
            self.store.drop(record)  # the record goes before the slab is written again
            if slab is not None:
                self.arena.unkeep(slab)
            return
        learned = reading.learned if reading is not None and reading.manifest.step == record.step else {}
        if record.pending:  # completed with the checksums the restore computed (the rest hashed now)
            log.info("mpckpt: the snapshot of step %d kept in memory for %s had no checksums yet; completed with "
                     "those its restore computed", record.step, self.url)
            done = with_checksums(record, learned)
            if not done.pending:
                try:
                    self.store.publish_record(done, again=True)
                    record = done
                except (OSError, ValueError) as e:
                    log.warning("mpckpt: could not write the checksums into the kept record (%s)", e)
        with self._lock:
            self._kept = [(slab, record)]
        if record.pending:
            known: concurrent.futures.Future[dict[str, str]] = concurrent.futures.Future()
            known.set_result(learned)
            self._completion = self._complete_when(known, slab, record)
        if self._agreeing is not None:  # every rank restored it: it counts as held by every rank
            self._agreeing.submit(self._agree, record.step)

    # -- keeping a new snapshot ------------------------------------------------------------------
    def hashers(self, shards: list[Any], block_size: int) -> list[FileHasher]:
        """One hasher per shard file, for a copy that hashes as it goes (``copy_wave_fed``)."""
        return [FileHasher(s.header, block_size) for s in shards]

    def keep(self, *, step: int, seq: int, metrics: dict[str, Any], shards: list[Any], slab: Slab, small_name: str,
             small: Callable[[dict[str, list[str]]], bytes], block_size: int = 0,
             hashed: list[FileHasher] | None = None, pending: bool = False,
             uploaded: concurrent.futures.Future[dict[str, str]] | None = None,
             ) -> concurrent.futures.Future[int] | None:
        """``slab`` holds the complete snapshot of ``step`` (``shards``: the layout's ``ShardPlan``s;
        ``hashed``: their hashers, fed as the copy went; ``pending``: a single process's, completed
        after this returns; else they are hashed here): publish its record, keep it; the
        previously kept slab goes back to the pool. Returned: the future of its copies on other
        nodes (their number) when the job makes them.

        ``uploaded`` (with ``pending``): resolves, once the save's uploads of this slab are done,
        to the checksum of every shard file they wrote (by name). The uploaders hash each file as
        they write it from this very slab: the completion waits for those and hashes only the
        shards no upload wrote (reused, failed), instead of reading the whole slab again beside
        the training steps right after the save."""
        if not self.store.held:
            return None
        assert not (pending and (block_size or self.replicate)), "a rank's record is published with its checksums"
        if pending:
            digests: list[tuple[str | None, tuple[str, ...]]] = [(None, ())] * len(shards)
        elif hashed is not None:
            digests = [h.result() for h in hashed]
        else:
            view = memoryview(slab.segment.mmap)
            try:
                digests = list(self.pool.map(
                    lambda s: file_checksums(s.header, view[s.offset:s.offset + s.nbytes], block_size), shards))
            finally:
                view.release()
        spans = {s.filename: Span(s.header, s.offset, s.nbytes, d, b) for s, (d, b) in zip(shards, digests, strict=True)}
        blocks = {rel: list(span.blocks) for rel, span in spans.items()} if block_size else {}
        record = KeptRecord(uid=os.geteuid(), root=self.url, rank=self.rank, world_size=self.world_size, step=step,
                            seq=seq, data=self.store.new_data_name(), data_size=slab.capacity,
                            created_unix=time.time(), spans=spans, small={small_name: small(blocks)},
                            metrics=_json_safe_metrics(metrics))
        if self.found:  # saving without having restored them: the found ones are stale
            self.settle(None, set())
        self.arena.keep(slab)  # INVARIANT: never called holding our lock (the arena calls _reclaim holding its own)
        try:
            with self._lock:
                self.store.publish(record, slab.name)
                self._kept = [(s, r) for s, r in self._kept if s is not slab] + [(slab, record)]
        except OSError as e:
            self.arena.unkeep(slab)
            self.warn_once("publish", f"could not keep the snapshot of step {step} in memory ({e}); a crash now "
                           "restores from storage")
            return None
        self._let_go()
        if self._agreeing is not None:
            self._agreeing.submit(self._agree, step)
        if pending:
            self._completion = self._complete_when(uploaded, slab, record)
            return None
        return self.replicate(record, slab) if self.replicate is not None else None

    def _agree(self, step: int) -> None:
        """(The agreement thread.) Count ``step`` as kept by this rank, then let go of what a newer
        step agreed meanwhile makes unneeded. A store that fails is said once: the snapshots stay
        held (the budget still bounds them)."""
        assert self.agreement is not None
        try:
            self.agreement.post(step)
            self._learn()
        except Exception as e:
            self.warn_once("agree", f"could not count the snapshot of step {step} with the other ranks ({e}); older "
                           "snapshots stay held until the memory budget needs them")
            return
        self._let_go()

    def _learn(self) -> None:
        """Read which kept steps every rank holds, and which the copies need (the store), for ``_hold``."""
        assert self.agreement is not None
        held = self.held_steps()
        agreed = self.agreement.refresh(held)
        pins = self.pinned(held) if self.pinned is not None else set()
        with self._lock:
            self._agreed, self._pins = agreed, pins

    def holds(self, record: KeptRecord) -> bool:
        """Whether the snapshot ``record`` is still kept (its slab unwritten)."""
        with self._lock:
            return self._still_kept(record)

    def _hold(self) -> set[int]:
        """Of the steps kept now (our lock held), those to hold on to (``agreement.to_hold``)."""
        steps = [r.step for _, r in self._kept]
        if self.agreement is None:  # a single process: its newest
            return set(steps[-1:])
        return to_hold(steps, self._agreed, self._pins)

    def _drop_unheld(self) -> list[Slab]:
        """Remove the records of the snapshots no longer held (our lock held); their slabs."""
        hold = self._hold()
        gone = [(s, r) for s, r in self._kept if r.step not in hold]
        self._kept = [(s, r) for s, r in self._kept if r.step in hold]
        for _, record in gone:
            self.store.drop(record)  # INVARIANT: the record goes before the slab is written again
        return [s for s, _ in gone]

    def _let_go(self) -> None:
        """Let the slabs of snapshots no longer held go back to the pool."""
        with self._lock:
            slabs = self._drop_unheld()
        for slab in slabs:  # (outside our lock: the arena calls _reclaim holding its own)
            self.arena.unkeep(slab)

    def _still_kept(self, record: KeptRecord) -> bool:
        return any(r is record for _, r in self._kept)

    def _complete_when(self, uploaded: concurrent.futures.Future[dict[str, str]] | None, slab: Slab,
                       record: KeptRecord) -> concurrent.futures.Future[None]:
        """The future of ``record``'s completion (``_complete_later``), started now, or once
        ``uploaded`` says which checksums the uploads computed. A completion that cannot start
        (the completer shut down: closing) leaves the record pending, as a kill would."""
        finished: concurrent.futures.Future[None] = concurrent.futures.Future()
        finished.add_done_callback(self._completed)

        def start(known: dict[str, str]) -> None:  # (on the thread that resolved ``uploaded``)
            try:
                self._complete_later(slab, record, known, finished)
            except RuntimeError:  # "cannot schedule new futures after shutdown"
                finished.set_result(None)
            except BaseException as e:  # (said by ``_completed``; never lost in a callback)
                finished.set_exception(e)

        if uploaded is None:
            start({})
        else:
            uploaded.add_done_callback(lambda done: start(done.result() if done.exception() is None else {}))
        return finished

    def _complete_later(self, slab: Slab, record: KeptRecord, known: dict[str, str],
                        finished: concurrent.futures.Future[None]) -> None:
        """Hash the shard files of ``record`` (published pending) in ``slab`` that ``known`` has no
        checksum of, on the completer's two threads, and publish it again with every checksum,
        unless a newer snapshot or a save's need of the memory came first (the slab may then be
        written meanwhile: what was hashed is dropped); ``finished`` resolves when that is over.
        The last job waits for the others, which were queued before it (so started)."""
        files = [(rel, span) for rel, span in record.spans.items() if rel not in known]

        def digest(rel: str, span: Span) -> str | None:
            if not self._still_kept(record):
                return None
            view = memoryview(slab.segment.mmap)
            try:
                return file_checksums(span.header, view[span.offset:span.offset + span.nbytes], 0)[0]
            finally:
                view.release()

        others = [self.completer.submit(digest, rel, span) for rel, span in files[1:]]

        def last() -> None:
            try:
                digests = [digest(*files[0])] if files else []
                digests += [other.result() for other in others]
                if None in digests:
                    return
                done = with_checksums(record, {**known, **{rel: d for (rel, _), d in zip(files, digests, strict=True) if d}})
                with self._lock:
                    if self._still_kept(record):
                        self.store.publish_record(done, again=True)
                        self._kept = [(s, done if r is record else r) for s, r in self._kept]
            except BaseException as e:  # (said by ``_completed``)
                finished.set_exception(e)
            finally:
                if not finished.done():
                    finished.set_result(None)

        try:
            self.completer.submit(last)
        except RuntimeError:
            for other in others:
                other.cancel()
            raise

    def _completed(self, future: concurrent.futures.Future[None]) -> None:
        error = future.exception()
        if error is not None:  # the pending record stays: a restart completes it from the slab
            self.warn_once("complete", f"could not add the checksums to the record of the snapshot kept in memory "
                           f"({error!r}); a restart computes them from the snapshot")

    def wait(self, timeout_s: float) -> None:
        """Until the newest record's checksums are in it (``pending``), at most ``timeout_s``."""
        done = self._completion
        if done is not None:
            concurrent.futures.wait([done], timeout=timeout_s)

    def _reclaim(self, candidates: list[Slab]) -> list[Slab]:
        """(The arena's lock held.) A save needs the memory of one of the kept slabs ``candidates``
        (no upload holds them): the kept slabs given up, their records gone first. Those no longer
        held go without a word (a newer step agreed meanwhile: the counters are read now); else
        the oldest of ``candidates``, with a warning."""
        if self.agreement is not None:
            try:
                self._learn()
            except Exception as e:
                log.debug("mpckpt: reading the job's counters of kept steps: %s", e)
        with self._lock:
            gone = self._drop_unheld()
            if any(s in candidates for s in gone):
                return gone
            oldest = next(((s, r) for s, r in self._kept if s in candidates), None)
            if oldest is None:
                return gone
            self._kept.remove(oldest)
            self.store.drop(oldest[1])
            newest = not self._kept
        if newest:
            self.warn_once("budget", "the memory budget has no room to keep the newest snapshot in memory while "
                           "saving the next one; a crash now restores from storage. Raise memory_budget to about "
                           "twice the state to keep one")
        else:
            self.warn_once("budget-agreed", "the memory budget has no room to keep the step every rank holds beside "
                           "this rank's newest snapshot; a rank that fails in its step now may send the job back to "
                           "storage. Raise memory_budget to about three times the state of a rank")
        return [*gone, oldest[0]]

    def warn_once(self, key: str, text: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("mpckpt: %s", text)

    def close(self, *, leave: bool) -> None:
        """Let go (before the arena closes); ``leave``: the kept snapshot stays for the next process
        (with its checksums: a pending record is completed first)."""
        if not leave:
            with self._lock:
                self._kept = []  # (a pending record being completed: its completion stops)
        self.completer.shutdown(wait=True)
        if self._agreeing is not None:
            self._agreeing.shutdown(wait=True)
        with self._lock:
            for found in self.found:
                found.close()
            self.found = []
            self._kept = []
            self.store.release(leave=leave)
        self.pool.shutdown(wait=True)


def running_threads(count: int, name: str) -> concurrent.futures.ThreadPoolExecutor:
    """An executor whose ``count`` threads are running when it is returned. A thread started inside
    a save waits for the process's memory map behind the pages being faulted in: four started in an
    unprepared first save of 1 GiB took 240 ms, most of that save on 2 cores."""
    pool = executor(count, name)
    started = threading.Barrier(count + 1)
    for _ in range(count):  # each holds its thread until all are up, so each gets its own
        pool.submit(started.wait, 10.0)
    try:
        started.wait(10.0)
    except threading.BrokenBarrierError:
        pass  # (not up within 10 s: they start when first used)
    return pool
