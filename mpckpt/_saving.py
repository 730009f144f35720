"""How a save becomes shared-memory copies and upload jobs (and a report, upload jobs).

``Snapshotter`` owns everything between a validated ``save`` call and the jobs in the
uploader pool: the layout cache, taking slabs from the budget under the chosen policy
(block / skip / coalesce), the eager copy, the overlapped copy (``_overlap``), the shard
files of unchanged frozen tensors that are referenced instead of rewritten, and the write
jobs whose completion releases each slab. ``Checkpointer`` keeps the public API, the
futures and the error surfacing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from typing import Any

from mpckpt._arena import Arena, Slab
from mpckpt._copier import copy_wave
from mpckpt._layout import Layout, plan_layout
from mpckpt._ledger import Ledger, Pending
from mpckpt._overlap import BackgroundCopier, step_guarded_leaves
from mpckpt._pool import Job, UploaderPool
from mpckpt._snapshot import FlatState
from mpckpt._worker import UploadJob, WriteJob, file_digest
from mpckpt.config import BudgetPolicy, Config
from mpckpt.errors import ConfigError, UploadError
from mpckpt.format.manifest import USER_FILES, FileEntry
from mpckpt.restore import SKELETON_VERSION
from mpckpt.storage import Backend

_LAYOUT_CACHE = 8


class Snapshotter:
    """Turns flattened states into slabs and jobs for one checkpointer."""

    def __init__(self, config: Config, backend: Backend, root: str, ledger: Ledger, arena: Arena,
                 pool: UploaderPool, *, on_wait: Callable[[], None]) -> None:
        self.config = config
        self.backend = backend
        self._root = root
        self.ledger = ledger
        self.arena = arena
        self.pool = pool
        self._on_wait = on_wait
        self._copier: BackgroundCopier | None = None
        self._layouts: dict[Any, Layout] = {}
        # (layout key, shard file) -> (versions of its frozen tensors, where the file is committed)
        self._frozen_files: dict[tuple[int, str], tuple[tuple[tuple[int, int], ...], FileEntry]] = {}

    def forget_folder(self, name: str) -> None:
        """``name`` is being deleted: never reference files in it again."""
        self._frozen_files = {k: v for k, v in self._frozen_files.items() if v[1].ref != name}

    def close(self) -> None:
        if self._copier is not None:
            self._copier.close()

    def layout_for(self, flat: FlatState) -> Layout:
        key = (tuple([(leaf.name, leaf.code, leaf.source.shape) for leaf in flat.leaves]), flat.frozen)
        layout = self._layouts.get(key)
        if layout is None:
            layout = plan_layout(flat.leaves, budget_bytes=self.config.memory_budget_bytes, workers=self.config.workers,
                                 frozen=flat.frozen)
            if len(self._layouts) >= _LAYOUT_CACHE:
                self._layouts.pop(next(iter(self._layouts)))
            self._layouts[key] = layout
        return layout

    def take_slab(self, layout: Layout) -> Slab | None:
        need = layout.waves[0].nbytes
        slab = self.arena.try_acquire(need)
        if slab is not None:
            if len(layout.waves) == 1:
                self.arena.ensure_spare(need)  # for the next save, while this one uploads
            return slab
        policy = self.config.policy
        if policy is BudgetPolicy.SKIP:
            return None
        if policy is BudgetPolicy.COALESCE:
            self._coalesce_one()
            slab = self.arena.try_acquire(need)
            if slab is not None:
                return slab
        return self.arena.acquire(need, timeout_s=self.config.timeout_s, on_wait=self._on_wait)

    def _coalesce_one(self) -> None:
        """Drop the newest pending checkpoint none of whose uploads has started."""
        assert self.pool is not None
        for record in reversed(self.ledger.pending()):
            if record.kind != "state" or record.outcome is not None or not record.submitted_all:
                continue
            if self.pool.cancel(record.seq):
                record.future.stats.status = "coalesced"
                for slab in record.slabs:
                    self.arena.release(slab)
                record.slabs.clear()
                if record.staging is not None:
                    self.backend.abort(record.staging)
                self.ledger.resolve(record, "dropped")
                return

    def reuse_unchanged(self, record: Pending, flat: FlatState, layout: Layout) -> _Reuse:
        """Frozen shards whose tensors did not change since a committed save: reference them."""
        reuse = _Reuse()
        written: dict[str, tuple[tuple[int, int], ...]] = {}
        for wave in layout.waves:
            for shard in wave.shards:
                if not shard.frozen:
                    continue
                versions = flat.versions(sorted({p.leaf for p in shard.pieces}))
                known = self._frozen_files.get((layout.key, shard.filename))
                if known is not None and known[0] == versions:
                    reuse.files[shard.filename] = known[1]
                    reuse.leaves.update(p.leaf for p in shard.pieces)
                else:
                    written[shard.filename] = versions
        record.files.update(reuse.files)
        if written:
            def remember() -> None:  # only committed files may ever be referenced
                for filename, versions in written.items():
                    e = record.files[filename]
                    self._frozen_files[(layout.key, filename)] = (versions, FileEntry(e.size, e.checksum, ref=record.name))
            record.after_commit.append(remember)
        return reuse

    def snapshot_eager(self, record: Pending, flat: FlatState, layout: Layout, first: Slab | None,
                        reuse: _Reuse) -> None:
        """Copy every wave now (the caller settles the record if this raises)."""
        snap_start = time.perf_counter()
        for index in range(len(layout.waves)):
            slab = first if index == 0 else self.arena.acquire(layout.waves[index].nbytes,
                                                               timeout_s=self.config.timeout_s)
            assert slab is not None
            copy_wave(flat, layout, index, slab, only=reuse.needs_copy)
            self._submit_wave(record, layout, index, slab, reuse)
        self.ledger.all_submitted(record)
        record.snapshot_done_at = time.perf_counter()
        record.future.stats.snapshot_ms = (record.snapshot_done_at - snap_start) * 1e3

    def snapshot_overlapped(self, record: Pending, state: Any, flat: FlatState, layout: Layout, slab: Slab | None,
                             reuse: _Reuse) -> None:
        assert slab is not None
        snap_start = time.perf_counter()
        guarded = step_guarded_leaves(state, flat) - reuse.leaves
        # what the next forward may change in place (buffers) is copied now
        copy_wave(flat, layout, 0, slab, only=lambda leaf: leaf not in guarded and reuse.needs_copy(leaf))

        def rest() -> None:
            submitted = False
            try:
                copy_wave(flat, layout, 0, slab, only=guarded.__contains__)
                self._submit_wave(record, layout, 0, slab, reuse)
                submitted = True
            except BaseException as e:  # surfaces through the save's future, not lost
                if not submitted and slab not in record.slabs:
                    self.arena.release(slab)
                self.ledger.resolve(record, "failed", e)
                raise
            finally:
                record.snapshot_done_at = time.perf_counter()
                record.future.stats.snapshot_ms = (record.snapshot_done_at - snap_start) * 1e3
                self.ledger.all_submitted(record)

        if self._copier is None:
            self._copier = BackgroundCopier(timeout_s=self.config.timeout_s)
        self._copier.run(record.future.stats, rest)

    def barrier(self) -> None:
        """Wait until an overlapped snapshot has finished copying (see ``_overlap``)."""
        if self._copier is not None:
            self._copier.barrier()

    def _submit_wave(self, record: Pending, layout: Layout, index: int, slab: Slab, reuse: _Reuse) -> None:
        assert self.pool is not None
        shards = [s for s in layout.waves[index].shards if s.filename not in reuse.files]
        if not shards:
            self.arena.release(slab)
            return
        left = {"jobs": len(shards)}
        record.slabs.append(slab)
        with self.ledger.lock:
            record.jobs_left += len(shards)

        def wave_done() -> None:  # the slab is free once every shard of the wave is written
            left["jobs"] -= 1
            if left["jobs"] == 0:
                if slab in record.slabs:
                    record.slabs.remove(slab)
                self.arena.release(slab)

        done = self._file_done(record, "writing shard", then=wave_done)
        self.pool.submit(*(
            Job("write", WriteJob(f"{record.staging}/{shard.filename}", slab.name, slab.capacity,
                                  shard.offset, shard.nbytes, shard.header), done, tag=record.seq, step=record.step,
                timeout_s=self.config.job_deadline_s(shard.nbytes))
            for shard in shards))

    def _file_done(self, record: Pending, doing: str, *,
                   then: Callable[[], None] | None = None) -> Callable[[Job, dict[str, Any] | None, BaseException | None], None]:
        """The pool callback for one file of ``record``: record its entry or the failure."""

        def done(job: Job, result: dict[str, Any] | None, error: BaseException | None) -> None:
            rel = job.payload.relpath[len(record.staging or "") + 1:]
            if error is not None:
                err = UploadError(f"step {record.step}: {doing} {rel} failed: {type(error).__name__}: {error}",
                                  step=record.step, shard=rel)
                err.__cause__ = error
                self.ledger.resolve(record, "failed", err)
                self.ledger.file_failed(record)
            else:
                assert result is not None
                self.ledger.file_done(record, rel, FileEntry(result["size"], result["checksum"]))
            if then is not None:
                then()

        return done

    def submit_upload(self, record: Pending, folder: str, files: list[str]) -> None:
        assert self.pool is not None
        with self.ledger.lock:
            record.jobs_left += len(files)
        done = self._file_done(record, "uploading")
        for rel in files:
            # the user's files go under files/: no name of theirs can collide with ours
            payload = UploadJob(f"{record.staging}/{USER_FILES}{rel}", os.path.join(folder, rel))
            size = os.path.getsize(payload.local_path)
            self.pool.submit(Job("upload", payload, done, tag=record.seq, step=record.step,
                                 timeout_s=self.config.job_deadline_s(size)))

    def adopt_directory(self, record: Pending, folder: str, files: list[str]) -> None:
        """Commit a folder already on the root's filesystem by moving it to ``<staging>/files``."""
        for rel in files:
            record.files[USER_FILES + rel] = FileEntry(*file_digest(os.path.join(folder, rel)))
        target = os.path.join(self._root, record.staging or "", USER_FILES.rstrip("/"))
        try:
            os.rename(folder, target)
        except OSError as e:
            raise ConfigError(f"mode=NO_UPLOAD: cannot move {folder} into {self.backend.url} ({e.strerror}); "
                              "it must be on the same filesystem, or use ASYNC") from e

@dataclasses.dataclass
class _Reuse:
    """Shard files of this save that are referenced, not written, and the leaves they hold."""

    files: dict[str, FileEntry] = dataclasses.field(default_factory=dict)
    leaves: set[int] = dataclasses.field(default_factory=set)

    def needs_copy(self, leaf: int) -> bool:
        return leaf not in self.leaves



def skeleton_bytes(flat: FlatState, layout: Layout) -> bytes:
    """The JSON skeleton of one save: tree, tensor table and where each leaf's bytes are."""
    from mpckpt._dtypes import dtype_name

    leaves = [
        {"name": leaf.name, "dtype": dtype_name(leaf.dtype), "shape": list(leaf.shape), "raw": leaf.raw,
         "parts": [list(p) for p in layout.parts.get(i, [])]}
        for i, leaf in enumerate(flat.leaves)
    ]
    doc = {"version": SKELETON_VERSION, "tree": flat.tree, "table": flat.table, "leaves": leaves}
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


