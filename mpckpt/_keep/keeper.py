"""What one writer keeps in this node's memory: the newest complete snapshot, and the one it found.

``keep`` runs once a snapshot's copy into its slab is complete (an eager save before it
returns, an overlapped one in its background copy): it publishes the record (``store``) and
marks the slab kept in the arena: no save copies into it until a newer snapshot is complete.
Then the previous kept slab goes back to the pool (once its own uploads are done). An ASYNC
save is thus recoverable on this node as soon as ``save()`` returns, before its upload, and a
``mode="memory"`` save is never uploaded at all.

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

At open, the snapshot a previous process of this root and rank kept is found (``found``) and
offered to the restore as a ``memory`` source (``source_for``; in a job, ``_peer.inventory``
offers every rank's, wherever they are held). After the restore
(``settle``) its slab is taken over: it stays kept when that step is only in memory; when the
step is on storage its record goes and the slab serves the next save (no fresh pages). A
snapshot found and not restored is stale and removed.

A kept slab counts against the memory budget. When a save needs the memory of the kept slab
and nothing else is free, the arena gives it up (``reclaim``): the record goes first, with a
warning, so nothing ever reads a slab being written.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from mpckpt._keep.digest import SpanHasher, hash_span, with_checksums
from mpckpt._keep.record import KeptRecord, Span
from mpckpt._keep.source import MemorySource
from mpckpt._keep.store import Found, KeptStore, data_path, read_kept
from mpckpt._stage.arena import Arena, Slab
from mpckpt._stage.shm import Segment
from mpckpt.format.manifest import Manifest, _json_safe_metrics

log = logging.getLogger("mpckpt")


class Keeper:
    """The kept snapshot of one writer (one rank of a job), and the one found at open."""

    def __init__(self, url: str, arena: Arena, *, enabled: bool, rank: int = 0, world_size: int = 1) -> None:
        self.url, self.arena, self.enabled = url, arena, enabled
        self.rank, self.world_size = rank, world_size
        self.store = KeptStore(url, rank)
        self.found: Found | None = None
        # the job's copies on other nodes (``_peer``): called with each record kept and its slab
        self.replicate: Callable[[KeptRecord, Slab], concurrent.futures.Future[int]] | None = None
        self.kept: tuple[Slab, KeptRecord] | None = None
        self._lock = threading.Lock()
        # threads started now, not inside a save (``running_threads``)
        self.pool = running_threads(2, "mpckpt-keep-copy")  # copies (and a rank's hashes) of a save
        self.completer = running_threads(2, "mpckpt-keep-complete")  # the checksums of a pending record
        self._completion: concurrent.futures.Future[None] | None = None
        self._warned: set[str] = set()
        if self.store.hold():
            self.found = read_kept(url, rank, world_size)
            if self.found is None:
                self.store.discard()  # a torn publish, or data no record lists
        arena.reclaim = self._reclaim

    # -- the found snapshot: restoring from it ----------------------------------------------------
    def in_memory(self) -> dict[int, Manifest]:
        """The step found in memory, as its manifest (a single process's: a job asks ``_peer``)."""
        found = self.found
        return {} if found is None else {found.record.step: found.record.manifest()}

    def source_for(self, manifest: Manifest) -> MemorySource | None:
        """The memory source of checkpoint ``manifest`` when the snapshot found at open is it."""
        found = self.found
        if found is None or found.record.step != manifest.step:
            return None
        mine = self.in_memory().get(manifest.step)
        if mine is None:
            return None
        if manifest.seq != mine.seq and found.record.seq >= 0:
            return None  # another save of that step (storage's is not the one kept)
        if any(manifest.files.get(rel, entry).checksum != entry.checksum for rel, entry in mine.files.items()):
            return None
        return MemorySource([found], manifest)

    def settle(self, restored: int | None, durable: set[int]) -> None:
        """After a restore (``restored``: its step; ``durable``: the steps on storage): take over
        the found snapshot's slab, or remove it when it was not what was restored."""
        found, self.found = self.found, None
        if found is None:
            return
        record = found.record
        found.close()
        if restored != record.step or not self.store.held:
            self.store.discard()
            return
        try:
            segment = Segment.adopt(data_path(record.data), record.data_size)
        except OSError as e:
            log.warning("mpckpt: could not take over the snapshot kept in memory (%s); it is removed", e)
            self.store.discard()
            return
        on_storage = record.step in durable
        slab = self.arena.adopt(segment, kept=self.enabled and not on_storage)
        if slab is None or on_storage or not self.enabled:
            self.store.discard()  # the record goes before the slab is written again
            if slab is not None:
                self.arena.unkeep(slab)
            return
        with self._lock:
            self.kept = (slab, record)

    # -- keeping a new snapshot ------------------------------------------------------------------
    def hashers(self, shards: list[Any], block_size: int) -> list[SpanHasher]:
        """One hasher per shard file, for a copy that hashes as it goes (``copy_wave_fed``)."""
        return [SpanHasher(s.header, block_size) for s in shards]

    def keep(self, *, step: int, seq: int, metrics: dict[str, Any], shards: list[Any], slab: Slab, small_name: str,
             small: Callable[[dict[str, list[str]]], bytes], block_size: int = 0,
             hashed: list[SpanHasher] | None = None, pending: bool = False,
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
                    lambda s: hash_span(s.header, view[s.offset:s.offset + s.nbytes], block_size), shards))
            finally:
                view.release()
        spans = {s.filename: Span(s.header, s.offset, s.nbytes, d, b) for s, (d, b) in zip(shards, digests, strict=True)}
        blocks = {rel: list(span.blocks) for rel, span in spans.items()} if block_size else {}
        record = KeptRecord(uid=os.geteuid(), root=self.url, rank=self.rank, world_size=self.world_size, step=step,
                            seq=seq, data=self.store.new_data_name(), data_size=slab.capacity,
                            created_unix=time.time(), spans=spans, small={small_name: small(blocks)},
                            metrics=_json_safe_metrics(metrics))
        if self.found is not None:  # saving without having restored it: the found one is stale
            self.settle(None, set())
        self.arena.keep(slab)  # INVARIANT: never called holding our lock (the arena calls _reclaim holding its own)
        try:
            with self._lock:
                self.store.publish(record, slab.name)
                old, self.kept = self.kept, (slab, record)
        except OSError as e:
            self.arena.unkeep(slab)
            self.warn_once("publish", f"could not keep the snapshot of step {step} in memory ({e}); a crash now "
                           "restores from storage")
            return None
        if old is not None and old[0] is not slab:
            self.arena.unkeep(old[0])
        if pending:
            self._completion = self._complete_when(uploaded, slab, record)
            return None
        return self.replicate(record, slab) if self.replicate is not None else None

    def _still_kept(self, record: KeptRecord) -> bool:
        kept = self.kept
        return kept is not None and kept[1] is record

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
                return hash_span(span.header, view[span.offset:span.offset + span.nbytes], 0)[0]
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
                        self.kept = (slab, done)
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

    def _reclaim(self, slab: Slab) -> None:
        """The arena needs the kept slab's memory for a save: the record goes first."""
        with self._lock:
            if self.kept is None or self.kept[0] is not slab:
                return
            self.kept = None
            self.store.discard()
        if "budget" not in self._warned:
            self._warned.add("budget")
            log.warning("mpckpt: the memory budget has no room to keep the newest snapshot in memory while saving "
                        "the next one; a crash now restores from storage. Raise memory_budget to about twice the "
                        "state to keep one")

    def warn_once(self, key: str, text: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("mpckpt: %s", text)

    def close(self, *, leave: bool) -> None:
        """Let go (before the arena closes); ``leave``: the kept snapshot stays for the next process
        (with its checksums: a pending record is completed first)."""
        if not leave:
            with self._lock:
                self.kept = None  # (a pending record being completed: its completion stops)
        self.completer.shutdown(wait=True)
        with self._lock:
            if self.found is not None:
                self.found.close()
                self.found = None
            self.kept = None
            self.store.release(leave=leave)
        self.pool.shutdown(wait=True)


def running_threads(count: int, name: str) -> concurrent.futures.ThreadPoolExecutor:
    """An executor whose ``count`` threads are running when it is returned. A thread started inside
    a save waits for the process's memory map behind the pages being faulted in: four started in an
    unprepared first save of 1 GiB took 240 ms, most of that save on 2 cores."""
    pool = concurrent.futures.ThreadPoolExecutor(count, thread_name_prefix=name)
    started = threading.Barrier(count + 1)
    for _ in range(count):  # each holds its thread until all are up, so each gets its own
        pool.submit(started.wait, 10.0)
    try:
        started.wait(10.0)
    except threading.BrokenBarrierError:
        pass  # (not up within 10 s: they start when first used)
    return pool
