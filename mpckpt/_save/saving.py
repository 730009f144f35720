"""How a save becomes shared-memory copies and write jobs.

``Snapshotter.save`` takes a validated call of ``Checkpointer.save`` (step checked, metrics
converted) and does, on the training thread: flatten the state (bad input fails here, before
anything is written), find its layout (``layout``), take the first slab under the budget
policy (``budget``), open the checkpoint's record in the ledger, reference unchanged frozen
shards (``reuse``), copy, and queue one write job per shard. The copy is either eager (every
wave now) or overlapped (``overlap``: parameters and optimizer state are copied in the
background until the next ``optimizer.step()``). Each wave's slab goes back to the budget when
the last shard written from it is durable.

In a multi-rank save (``planner``) this rank's layout leaves out what other ranks write
(``_dist.plan``), its shards are named with its rank, each file's blocks are checksummed
for ranged reads, and its skeleton is its own (``_stage.rank_skeleton``).

Nothing here touches storage: the jobs carry the checkpoint's staging path (or, for a frozen
shard, its new path in ``shared/``: ``reuse``), which the pool's dispatcher thread makes
before the first of them is sent (through the ``prepare_staging`` the runtime hands in:
staging folders are the commit side's), and the committer writes the skeleton and the manifest.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from mpckpt._codec.snapshot import FlatState, FlattenMemo, flatten
from mpckpt._dist.plan import BLOCK_BYTES, Planner
from mpckpt._futures import CheckpointerStats, SaveFuture, SaveStats
from mpckpt._ledger import Ledger, Pending
from mpckpt._save.budget import Budget
from mpckpt._stage import device
from mpckpt._stage.arena import Slab
from mpckpt._stage.copier import copy_wave, copy_wave_fed, estimate_state_bytes, views_of
from mpckpt._stage.layout import Layout, LayoutCache
from mpckpt._stage.overlap import BackgroundCopier, GuardedLeaves
from mpckpt._stage.rank_skeleton import RankSkeletonText
from mpckpt._stage.reuse import FrozenShards, Reuse
from mpckpt._stage.skeleton_text import SkeletonText
from mpckpt._stage.written import allocate, populate, write_wave
from mpckpt._upload.pool import Job, UploaderPool
from mpckpt._upload.worker import WriteJob
from mpckpt.config import Config
from mpckpt.errors import ConfigError
from mpckpt.format.checksums import FileHasher
from mpckpt.format.names import SKELETON_NAME, rank_prefix, rank_skeleton_name


class Keeps(Protocol):
    """What a save asks of the keeper of snapshots in memory (``_keep.keeper.Keeper``, a layer
    above: it is handed in, never imported)."""

    enabled: bool
    pool: concurrent.futures.ThreadPoolExecutor

    def hashers(self, shards: list[Any], block_size: int) -> list[FileHasher]: ...

    def keep(self, *, step: int, seq: int, metrics: dict[str, Any], shards: list[Any], slab: Slab, small_name: str,
             small: Callable[[dict[str, list[str]]], bytes], block_size: int = 0,
             hashed: list[FileHasher] | None = None, pending: bool = False,
             uploaded: concurrent.futures.Future[dict[str, str]] | None = None,
             ) -> concurrent.futures.Future[int] | None: ...

    def warn_once(self, key: str, text: str) -> None: ...


@dataclass(eq=False)
class Snapshotter:
    """Turns states into slabs and write jobs for one checkpointer."""

    config: Config
    ledger: Ledger
    budget: Budget
    pool: UploaderPool
    prepare_staging: Callable[[str], None]  # makes a checkpoint's staging folder (the commit side's)
    stats: CheckpointerStats
    layouts: LayoutCache = field(init=False)
    frozen: FrozenShards = field(init=False)
    memo: FlattenMemo = field(default_factory=FlattenMemo, init=False)
    skeleton: SkeletonText = field(default_factory=SkeletonText, init=False)  # skeleton.json's bytes
    rank_skeleton: RankSkeletonText = field(default_factory=RankSkeletonText, init=False)  # a rank's, in a job
    planner: Planner | None = None  # a multi-rank save's (None: a single process)
    keeper: Keeps | None = None      # keeps the newest complete snapshot in memory
    _copier: BackgroundCopier | None = field(default=None, init=False)
    _guarded: GuardedLeaves = field(default_factory=GuardedLeaves, init=False)  # (``overlap``)

    @property
    def _kept_by(self) -> Keeps:
        """The keeper, on the paths only a snapshot kept in memory takes."""
        assert self.keeper is not None, "a save that keeps its snapshot has a keeper"
        return self.keeper

    def __post_init__(self) -> None:
        self.layouts = LayoutCache(budget_bytes=self.config.memory_budget_bytes, workers=self.config.workers)
        self.frozen = FrozenShards(self.ledger)

    def save(self, step: int, state: Any, metrics: dict[str, Any], *, overlap: bool,
             memory: bool = False) -> SaveFuture:
        """Snapshot ``state`` as checkpoint ``step``; the future resolves at its commit (``memory``:
        once the snapshot is kept in memory, never uploaded)."""
        flat = flatten(state, allow_pickle=self.config.allow_pickle, memo=self.memo,
                       distributed=self.planner is not None)
        plan = None
        if self.planner is not None:  # this rank's part of a multi-rank save (``_dist``)
            plan = self.planner.plan(flat)
            layout = self.layouts.layout_for(flat, skip=plan.skip, prefix=rank_prefix(self.planner.group.rank))
        else:
            layout = self.layouts.layout_for(flat)
        stats = SaveStats(step, bytes=flat.nbytes)
        keeping = self._keeping(layout, step, memory)
        if memory:
            return self._save_in_memory(step, metrics, flat, layout, plan, stats)
        first = self.budget.take_first(layout) if layout.waves else None
        if layout.waves and first is None:
            warnings.warn(f"mpckpt: memory budget full, checkpoint of step {step} skipped (policy 'skip')",
                          stacklevel=3)
            if self.planner is not None:  # the other ranks must hear of it: the step is dropped on all
                with self.ledger.recording(step, "state", stats, metrics) as record:
                    pass
                self.ledger.drop(record, "skipped")
                return record.future
            stats.status = "skipped"
            future = SaveFuture(stats)
            self.stats.saves.append(stats)
            future._resolve(None)
            return future

        def release_first(record: Pending) -> None:  # unless a wave job or the background copy owns it
            if first is not None and not self.ledger.holds(record, first):
                self.budget.release(first)

        with self.ledger.recording(step, "state", stats, metrics, on_error=release_first) as record:
            if self.planner is not None:
                group = self.planner.group
                self.ledger.add_small_file(record, rank_skeleton_name(group.rank), lambda: self.rank_skeleton(
                    flat, layout, plan, record.blocks, rank=group.rank, world_size=group.world_size))
            else:
                self.ledger.add_small_file(record, SKELETON_NAME, lambda: self.skeleton(flat, layout))
            reuse = self.frozen.reuse_unchanged(record, flat, layout)
            stats.written_bytes = sum(len(s.header) + s.nbytes for w in layout.waves for s in w.shards
                                      if s.filename not in reuse.files)
            kept = functools.partial(self._keep, step, record.seq, metrics, flat, layout, plan,
                                     stats=stats) if keeping else None
            guarded: frozenset[int] | None = None
            others: frozenset[int] | None = None
            if overlap and len(layout.waves) == 1:
                guarded, others = self._guarded.of(state, flat)
                if reuse.leaves:  # (frozen leaves whose shards are reused: new sets, not kept)
                    guarded = guarded - reuse.leaves
                    others = frozenset(range(len(flat.leaves))) - guarded
            if guarded is not None and (guarded or flat.on_cuda):
                self._snapshot_overlapped(record, flat, layout, first, reuse, kept, guarded=guarded, others=others)
            elif flat.on_cuda and kept is not None and self.planner is not None:
                # copied now; a rank's record waits for its block checksums: hashed off the training thread
                self._snapshot_overlapped(record, flat, layout, first, reuse, kept, copied=True)
            else:
                self._snapshot_eager(record, flat, layout, first, reuse, kept)
        return record.future

    # -- keeping snapshots in memory (``_keep``) ---------------------------------------------------
    def _keeping(self, layout: Layout, step: int, memory: bool) -> bool:
        """Whether this save's snapshot is kept in memory: one slab holds it whole."""
        if self.keeper is None or not (memory or self.keeper.enabled) or not layout.waves:
            if memory and self.keeper is None:
                raise ConfigError("mode='memory' needs a writer Checkpointer")
            return False
        if len(layout.waves) == 1:
            return True
        text = (f"the state ({layout.nbytes >> 20} MiB) is larger than the memory budget "
                f"({self.config.memory_budget_bytes >> 20} MiB), so no snapshot of it fits one slab to keep in memory; "
                "raise memory_budget (MPCKPT_MEMORY_BUDGET) to about twice the state")
        if memory:
            raise ConfigError(f"save(step={step}, mode='memory'): {text}")
        self.keeper.warn_once("waves", text)
        return False

    def _copy_kept(self, kept: Callable[..., Any], flat: FlatState, layout: Layout, slab: Slab,
                   uploaded: concurrent.futures.Future[dict[str, str]] | None = None) -> Any:
        """Copy the one wave of a snapshot to keep and keep it (``kept``: ``_keep`` bound to the
        save). A single process's record is published before its checksums, completed after
        ``save()`` returns (``Keeper.keep``, ``pending``), with those the uploads of the slab
        compute (``uploaded``, resolved by ``_submit_wave``); a rank's copy hashes each piece as
        it lands, since its record (its skeleton) lists its block checksums."""
        if self.planner is None:
            self._copy(flat, layout, 0, slab, None)
            return kept(slab, pending=True, uploaded=uploaded)
        hashers = self._kept_by.hashers(layout.waves[0].shards, BLOCK_BYTES)

        def feed(i: int, view: memoryview) -> None:
            hashers[i].update(view)

        return kept(slab, hashers if self._copy_whole(flat, layout, 0, slab, feed) else None)

    def _copy_whole(self, flat: FlatState, layout: Layout, index: int, slab: Slab,
                    feed: Callable[[int, memoryview], None] | None) -> bool:
        """Copy wave ``index`` of a snapshot, every leaf, shard by shard on the keeper's two threads
        (with many small tensors, faster than one ``_foreach_copy_`` of them all), handing each
        shard's bytes to ``feed`` as they land (while in the cache); False when the state cannot be
        copied so (on a GPU, or a large tensor not contiguous: copied by ``copy_wave``, not fed)."""
        pool = self._kept_by.pool
        if slab.sparse:  # made in this save: written through its file (``written``)
            if write_wave(flat, layout, index, slab, feed=feed, pool=pool):
                populate(slab)
                return True
            allocate(slab)
        if copy_wave_fed(flat, layout, index, slab, feed or _unfed, pool):
            return True
        copy_wave(flat, layout, index, slab)
        return False

    def _copy(self, flat: FlatState, layout: Layout, index: int, slab: Slab, reuse: Reuse | None) -> None:
        """Copy wave ``index`` into ``slab``: every leaf (``_copy_whole``), or those not reused as
        frozen (``reuse``)."""
        only = reuse.needs_copy if reuse is not None and reuse.leaves else None
        if only is None and self.keeper is not None:
            self._copy_whole(flat, layout, index, slab, None)
            return
        if slab.sparse:  # made in this save: written through its file (``written``)
            if only is None and write_wave(flat, layout, index, slab):
                populate(slab)
                return
            allocate(slab)
        copy_wave(flat, layout, index, slab, only=only)

    def _keep(self, step: int, seq: int, metrics: dict[str, Any], flat: FlatState, layout: Layout, plan: Any,
              slab: Slab, hashed: list[Any] | None = None, stats: SaveStats | None = None,
              pending: bool = False, uploaded: concurrent.futures.Future[dict[str, str]] | None = None) -> Any:
        """``slab`` holds the complete snapshot: keep it (``Keeper.keep``; hashed there unless
        ``hashed`` or ``pending``); the future of its copies on other nodes, if the job makes them."""
        if self.planner is not None:
            group = self.planner.group
            small_name = rank_skeleton_name(group.rank)

            def small(blocks: dict[str, list[str]]) -> bytes:
                return self.rank_skeleton(flat, layout, plan, blocks, rank=group.rank, world_size=group.world_size)
        else:
            small_name = SKELETON_NAME

            def small(blocks: dict[str, list[str]]) -> bytes:
                return self.skeleton(flat, layout)
        copies = self._kept_by.keep(step=step, seq=seq, metrics=metrics, shards=layout.waves[0].shards, slab=slab,
                                  small_name=small_name, small=small,
                                  block_size=BLOCK_BYTES if self.planner is not None else 0, hashed=hashed,
                                  pending=pending, uploaded=uploaded)
        if copies is not None and stats is not None:
            copies.add_done_callback(lambda done: setattr(stats, "peer_copies", done.result()))
        return copies

    def _save_in_memory(self, step: int, metrics: dict[str, Any], flat: FlatState, layout: Layout, plan: Any,
                        stats: SaveStats) -> SaveFuture:
        """A ``mode="memory"`` save: copied and kept, never uploaded; resolved when kept, and when
        the job copies snapshots to other nodes (``peer_copies``), once those copies are in place."""
        started = time.perf_counter()
        self.ledger.take_step(step)
        slab = self.budget.take_first(layout)
        future = SaveFuture(stats)
        copies = None
        if slab is None:
            warnings.warn(f"mpckpt: memory budget full, snapshot of step {step} skipped (policy 'skip')", stacklevel=3)
            stats.status = "skipped"
        else:
            try:
                copies = self._copy_kept(functools.partial(self._keep, step, -1, metrics, flat, layout, plan),
                                         flat, layout, slab)
            finally:
                self.budget.release(slab)
            self.budget.spare_for(layout)
            stats.status = "in_memory"
            stats.snapshot_ms = (time.perf_counter() - started) * 1e3
        self.stats.saves.append(stats)
        if copies is None:
            future._resolve(None)
        else:
            def copied(done: Any) -> None:
                stats.peer_copies = done.result()
                future._resolve(None)
            future.on_wait = getattr(copies, "hurry", None)  # a loop that waits gets its copy at full speed
            copies.add_done_callback(copied)
        return future

    def warm(self, state: Any) -> None:
        """Do ahead what the first saves of ``state`` would (``prepare``): walk it twice (the second
        walk is what every later save's is: modules read from their tree, its figures checked by
        the memo's guard), plan its layout, make the slab views of every idle slab that could hold
        it and, when snapshots are kept, its skeleton's bytes. A single process's only: a rank's
        layout depends on a plan all ranks agree on at each save."""
        if self.planner is not None:
            return
        for _ in range(2):
            flat = flatten(state, allow_pickle=self.config.allow_pickle, memo=self.memo)
        layout = self.layouts.layout_for(flat)
        if not layout.waves:
            return
        for slab in self.budget.arena.idle():
            if slab.capacity >= layout.waves[0].nbytes:
                views_of(slab, layout, 0)
        if self.keeper is not None and self.keeper.enabled and len(layout.waves) == 1:
            self.skeleton(flat, layout)

    def slab_bytes_for(self, state: Any) -> int:
        """The shared memory the first save of ``state`` takes (in a job: this rank's part), with a
        little room, at most the budget: what ``prepare`` and warming make ahead."""
        flat = flatten(state, allow_pickle=self.config.allow_pickle, memo=self.memo,
                       distributed=self.planner is not None)
        need = estimate_state_bytes(state, flat)
        if self.planner is not None:  # a rank of a job writes only its part (the plan save uses too)
            need -= sum(flat.leaves[i].nbytes for i in self.planner.plan(flat).skip)
        return min(int(need * 1.02) + (4 << 20), self.config.memory_budget_bytes)

    def barrier(self) -> None:
        """Wait until an overlapped snapshot has finished copying (see ``overlap``)."""
        if self._copier is not None:
            self._copier.barrier()

    def close(self) -> None:
        if self._copier is not None:
            self._copier.close()

    # -- copies ---------------------------------------------------------------------------------
    def _snapshot_eager(self, record: Pending, flat: FlatState, layout: Layout, first: Slab | None,
                        reuse: Reuse, kept: Callable[..., None] | None = None) -> None:
        """Copy every wave now (``recording`` settles the record if this raises); ``kept``: keep the
        snapshot in memory (one wave, every leaf copied, frozen ones too)."""
        started = time.perf_counter()
        uploaded = _uploads_of_kept() if kept is not None and self.planner is None else None
        try:
            for index in range(len(layout.waves)):
                slab = first if index == 0 else self.budget.take(layout.waves[index].nbytes)
                assert slab is not None
                if kept is not None:  # copied whole (frozen leaves too), then kept
                    self._copy_kept(kept, flat, layout, slab, uploaded)
                else:
                    self._copy(flat, layout, index, slab, reuse)
                self._submit_wave(record, layout, index, slab, reuse, uploaded)
        except BaseException:
            _settle(uploaded, {})  # (nothing uploads this slab: the kept record's checksums are all hashed)
            raise
        self.ledger.all_submitted(record, snapshot_started=started)
        self.budget.spare_for(layout)

    def _snapshot_overlapped(self, record: Pending, flat: FlatState, layout: Layout,
                             slab: Slab | None, reuse: Reuse, kept: Callable[..., None] | None = None, *,
                             copied: bool = False, guarded: frozenset[int] | None = None,
                             others: frozenset[int] | None = None) -> None:
        """The copy of what only an optimizer step changes (``guarded``; a CPU state with none is
        saved eagerly) runs in the background (``overlap``), and so do keeping and submitting the
        wave. ``copied`` (a GPU state's eager save that keeps its snapshot): every copy is done
        before this returns; only the hash that keeping needs (a read of the whole slab, longer
        than the copy from the device) and the submission run after. (A CPU state's eager save
        hashes as it copies and keeps before it returns: an ASYNC save counts once it returns.)
        ``others``: every leaf not in ``guarded`` (the sets stay the same objects between saves of
        the same tensors, so the GPU copies' plans restricted to them are kept)."""
        assert slab is not None
        started = time.perf_counter()
        allocate(slab)  # (a slab made in this save: copied through its map, in two parts)
        late: device.Events | None
        if copied:
            guarded = frozenset()
            late = copy_wave(flat, layout, 0, slab)  # every leaf (kept: frozen ones too), waited for: []
        else:
            assert guarded is not None and others is not None
            # what the next forward may change in place (buffers) is copied now (kept: frozen ones too);
            # on a GPU: enqueued, and training's stream waits for it there, the host does not
            plain = kept is not None or not reuse.leaves  # (else the frozen leaves are not copied)
            early = copy_wave(flat, layout, 0, slab, wait=False, only=(None if not guarded else others) if plain else
                              lambda leaf: leaf not in guarded and reuse.needs_copy(leaf))
            # on a GPU the rest is enqueued now too, behind it on mpckpt's stream: the next optimizer
            # step's kernels wait for it on the GPU (``BackgroundCopier``), this thread for nothing
            try:
                late = copy_wave(flat, layout, 0, slab, wait=False, only=guarded) if flat.on_cuda else None
            except BaseException:
                device.wait(early)  # nothing may still be landing in a slab given back
                raise
            device.stream_wait(early)

        def rest() -> None:
            submitted = False
            uploaded = _uploads_of_kept() if kept is not None and self.planner is None else None
            try:
                if late is None:
                    if guarded:
                        copy_wave(flat, layout, 0, slab, only=guarded)
                else:
                    device.wait(late)  # (``flat`` holds the sources until their copies are done)
                if kept is not None:  # (a single process's checksums after: ``_copy_kept``)
                    kept(slab, pending=self.planner is None, uploaded=uploaded)
                self._submit_wave(record, layout, 0, slab, reuse, uploaded)
                submitted = True
                self.budget.spare_for(layout)
            except BaseException as e:  # surfaces through the save's future, not lost
                if not submitted:  # (nothing uploads this slab: the kept record's checksums are all hashed)
                    _settle(uploaded, {})
                    if not self.ledger.holds(record, slab):
                        self.budget.release(slab)
                self.ledger.resolve(record, "failed", e)
                raise
            finally:
                self.ledger.all_submitted(record, snapshot_started=started)

        if self._copier is None:
            self._copier = BackgroundCopier(timeout_s=self.config.timeout_s)
        self._copier.run(record.stats, rest, device_events=late, copied=copied)

    def _submit_wave(self, record: Pending, layout: Layout, index: int, slab: Slab, reuse: Reuse,
                     uploaded: concurrent.futures.Future[dict[str, str]] | None = None) -> None:
        """Queue the upload of every shard of wave ``index`` that is not reused; ``uploaded`` (a
        kept snapshot's) resolves, once they are all done, to the checksums they computed."""
        shards = [s for s in layout.waves[index].shards if s.filename not in reuse.files]
        if not shards:
            self.budget.release(slab)
            _settle(uploaded, {})
            return
        left = {"jobs": len(shards)}
        self.ledger.hold(record, slab)
        self.ledger.add_jobs(record, len(shards))

        def wave_done() -> None:  # the slab is free once every shard of the wave is written
            left["jobs"] -= 1
            if left["jobs"] == 0:
                # (each written file's entry, recorded just before: a failed one has none)
                _settle(uploaded, {s.filename: entry.checksum for s in shards
                                   if (entry := record.files.get(s.filename)) is not None})
                self.ledger.let_go(record, slab)
                self.budget.release(slab)

        done = self.ledger.job_done(record, "writing shard", then=wave_done)
        self.pool.submit(*(
            Job("write", WriteJob(reuse.target(record.staging, shard.filename), slab.name, slab.capacity,
                                  shard.offset, shard.nbytes, shard.header,
                                  BLOCK_BYTES if self.planner is not None else 0), done, tag=record.seq, step=record.step,
                timeout_s=self.config.job_deadline_s(shard.nbytes))
            for shard in shards), before=lambda: self.prepare_staging(record.staging))


def _uploads_of_kept() -> concurrent.futures.Future[dict[str, str]]:
    """What the uploads of a kept slab hashed (``Keeper.keep``'s ``uploaded``)."""
    return concurrent.futures.Future()


def _settle(uploaded: concurrent.futures.Future[dict[str, str]] | None, digests: dict[str, str]) -> None:
    """Resolve ``uploaded`` with ``digests`` unless it is resolved already (the first word stands)."""
    if uploaded is not None:
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            uploaded.set_result(digests)


def _unfed(index: int, view: memoryview) -> None:
    """The feed of a copy nobody hashes as it lands."""
