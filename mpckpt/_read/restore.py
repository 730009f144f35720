"""Choosing the checkpoint to read and restoring it: one loop for one process and for a job.

``read_newest`` is the one place that chooses what to read: the newest committed checkpoint
of states (or the step asked for), damaged ones included (they say why they cannot be read),
then older ones with ``fallback``. A single process is a group of one (``_dist.group``: its
all_gather returns ``[mine]``), so a job runs the very same loop: every rank tries the same
step (rank 0's scan at open gave every rank the same list), one all_gather tells each how the
others fared, and all go on from the same step or all stop. ``restore`` is that loop with
"load and apply to the live state" as what each step is read for; ``mpckpt.load`` runs it
with "load" alone.

A newest checkpoint that does not verify stops the loop with an error naming the newest
older one that does (``_explained``), unless ``fallback``: then older ones are tried, and a
writer moves the damaged newer ones aside (``set_aside``) so its run saves those steps again.
A read-only reader beside a live writer may find a listed checkpoint deleted by the writer's
retention while it reads: that is not damage, the newest is looked up again.

The bytes come from the sources of a step tried nearest first (``sources``): today the root
(``StorageSource``); the recovery tier adds the snapshots kept in memory there.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch

from mpckpt._dist.group import RankGroup
from mpckpt._futures import LastRestore
from mpckpt._read.apply import apply_state, init_optimizer_state
from mpckpt._read.load import load_state, verify_checkpoint
from mpckpt._read.ranked import load_ranked_for, shard_like_live
from mpckpt._read.sources import Source, StorageSource, first_that_reads
from mpckpt._read.whole import load_whole
from mpckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, MpckptError, RankError, StateError, add_note
from mpckpt.format.manifest import Manifest
from mpckpt.format.names import MANIFEST_NAME, checkpoint_name, step_of
from mpckpt.storage import Backend

log = logging.getLogger("mpckpt")
T = TypeVar("T")
_VERIFY_OLDER = 3   # older checkpoints read to say which one is intact, when the newest does not verify
_ATTEMPTS = 8       # a read-only reader looks again this often when a writer deletes what it listed


class View(Protocol):
    """What reading needs of an open root: a writer's ``Runtime`` or a ``StorageView``."""

    backend: Backend
    read_only: bool
    group: RankGroup  # a single process: a group of one
    damaged: dict[int, Exception]

    def committed(self) -> dict[int, Manifest]: ...

    def reading(self, step: int | None) -> contextlib.AbstractContextManager[None]: ...

    def complete(self, manifest: Manifest) -> Manifest: ...

    def set_aside(self, steps: list[int], *, move: bool = True) -> list[str]: ...


class _Gone(Exception):
    """The checkpoint being read was deleted by a writer meanwhile (read-only readers only)."""


def candidates(committed: dict[int, Manifest], damaged: dict[int, Exception], step: int | None, url: str,
               kind: str | None = "state") -> list[int]:
    """Steps to try, newest first: ``[step]``, or every committed one of ``kind`` and every damaged one."""
    if step is not None:
        manifest = committed.get(step)
        if manifest is None and step not in damaged:
            raise CheckpointNotFoundError(f"no committed checkpoint of step {step} in {url}; committed steps: "
                                          f"{sorted(committed)[-20:]}")
        if manifest is not None and kind == "state" and manifest.kind != "state":
            raise StateError(f"step {step} of {url} is a directory checkpoint (files given to report()), not a "
                             f"state; get its files with ckpt.checkpoint({step}).to_directory(path)")
        return [step]
    return sorted({*(s for s, m in committed.items() if kind is None or m.kind == kind), *damaged}, reverse=True)


def sources(view: View, manifest: Manifest, *, stored: bool = True) -> list[Source]:
    """Where checkpoint ``manifest`` can be read from, any order (``first_that_reads`` sorts them):
    this node's memory when a snapshot kept there is that checkpoint (``_keep``), and storage
    unless the step is in memory only (``stored`` False)."""
    found: list[Source] = []
    in_memory = getattr(view, "memory_source", None)  # a writer's; a read-only view has none
    memory = in_memory(manifest) if in_memory is not None else None
    if memory is not None:
        found.append(memory)
    if stored:
        found.append(StorageSource(view.backend, checkpoint_name(manifest.step), manifest))
    return found


def _agreed_memory(view: View, committed: dict[int, Manifest]) -> dict[int, Manifest]:
    """Steps kept in memory only and newer than storage's newest, that every rank has (one
    all_gather: every rank agrees on the step before anyone copies)."""
    in_memory = getattr(view, "in_memory", None)
    newest = max((s for s, m in committed.items() if m.kind == "state"), default=-1)
    mine = {s: m for s, m in (in_memory() if in_memory is not None else {}).items()
            if s > newest and s not in committed}
    every = view.group.all_gather(sorted(mine))
    return {s: m for s, m in mine.items() if all(s in steps for steps in every)}


def read_newest(view: View, use: Callable[[Source], T], *, step: int | None = None, fallback: bool = False,
                explain: bool = True, kind: str | None = "state",
                ) -> tuple[int, T, Source, list[int]] | None:
    """``use`` the newest readable checkpoint (or ``step``): ``(step, result, source, skipped)``, or
    None when there is none. ``skipped``: newer damaged steps passed over (``fallback``).
    ``explain``: a damaged newest one's error names the newest older intact one."""
    url = view.backend.url
    for _ in range(_ATTEMPTS):
        stored, damaged = view.committed(), dict(view.damaged)
        committed = {**_agreed_memory(view, stored), **stored}
        order = candidates(committed, damaged, step, url, kind)
        if not order:
            # a writer may have committed a newer one and deleted the listed one before its manifest
            # was read: a reader looks again while there are checkpoint folders at all
            if view.read_only and any(step_of(n) is not None for n in view.backend.list_names()):
                continue
            return None
        try:
            return _first_readable(view, use, order, committed, damaged, step=step, fallback=fallback,
                                   explain=explain, stored=stored)
        except _Gone:
            continue
    raise CheckpointNotFoundError(f"{url}: each newest checkpoint was deleted while it was read, {_ATTEMPTS} "
                                  "times; the writer keeps too few (keep_last) for readers")


def _first_readable(view: View, use: Callable[[Source], T], order: list[int],
                    committed: dict[int, Manifest], damaged: dict[int, Exception], *, step: int | None,
                    fallback: bool, explain: bool, stored: dict[int, Manifest]) -> tuple[int, T, Source, list[int]]:
    """``committed``: storage's (``stored``) and the steps kept in memory only."""
    url, group = view.backend.url, view.group
    skipped: list[int] = []
    for candidate in order:
        failure: MpckptError | None = None
        try:
            if candidate in damaged:
                raise damaged[candidate]
            with view.reading(candidate):
                manifest = view.complete(committed[candidate])
                source, result = first_that_reads(sources(view, manifest, stored=candidate in stored), use)
        except MpckptError as e:
            if view.read_only and not _still_committed(view.backend, candidate):
                if step is not None:
                    raise CheckpointNotFoundError(
                        f"the checkpoint of step {step} in {url} was deleted while it was read "
                        "(retention of the run writing there); load a newer one") from e
                log.info("mpckpt: step %d of %s was deleted while it was read; looking for the newest again",
                         candidate, url)
                raise _Gone from e
            failure = e
        # every rank learns how every other fared, so all go on from the same step or all stop
        mine = None if failure is None else (str(failure), isinstance(failure, CorruptCheckpointError))
        every = group.all_gather(mine)
        failed = [(r, f[0]) for r, f in enumerate(every) if f is not None]
        if not failed:
            return candidate, result, source, skipped
        if candidate not in stored and candidate not in damaged and step is None:  # in memory only: every rank goes on
            log.warning("mpckpt: step %s kept in memory cannot be restored%s (%s); restoring from storage",
                        candidate, f" on rank {failed[0][0]}" if group.world_size > 1 else "", failed[0][1])
            continue
        if fallback and step is None and all(f[1] for f in every if f is not None):  # alike on every rank
            where = f" on rank {failed[0][0]}" if group.world_size > 1 else ""
            log.warning("mpckpt: step %s of %s does not verify%s, trying an older one: %s", candidate, url, where,
                        failed[0][1])
            skipped.append(candidate)
            continue
        if failure is not None:
            if explain and isinstance(failure, CorruptCheckpointError) and step is None and candidate == order[0]:
                raise _explained(view, failure, committed, order[1:]) from failure
            raise failure
        rank, why = failed[0]
        raise RankError(f"restoring step {candidate} failed on rank {rank}: {why}", step=candidate,
                        ranks=[r for r, _ in failed])
    raise CorruptCheckpointError(f"no checkpoint in {url} verifies (steps {order[:20]}); `mpckpt verify` says why "
                                 "for each")


def _explained(view: View, e: CorruptCheckpointError, committed: dict[int, Manifest],
               older: list[int]) -> CorruptCheckpointError:
    """The error of a newest checkpoint that does not verify: what happened, and the ways on."""
    url = view.backend.url
    intact = None
    for candidate in older[:_VERIFY_OLDER]:  # a few reads, once, on a path that otherwise stops the job
        if candidate not in committed:  # damaged: its manifest does not verify
            continue
        try:
            with view.reading(candidate):
                verify_checkpoint(view.backend, checkpoint_name(candidate), view.complete(committed[candidate]))
        except MpckptError:
            continue
        intact = candidate
        break
    if intact is not None:
        where = f"The newest intact checkpoint is step {intact}."
    elif older:
        where = (f"None of the {min(len(older), _VERIFY_OLDER)} next older checkpoints verifies either "
                 f"(`mpckpt verify {url}` checks them all).")
    else:
        where = "There is no older checkpoint."
    return type(e)(
        f"the newest checkpoint in {url} does not verify: {e}. {where} To go on from the newest one that "
        f"verifies: restore(state, fallback=True) (it moves the damaged checkpoint aside, kept, and the run saves "
        f"its step again), or delete it (`mpckpt rm {url} <step> --damaged`, or "
        f"ckpt.delete(<step>, damaged=True)) and restart. The live state was not changed", path=e.path)


def _still_committed(backend: Backend, step: int) -> bool:
    """Whether ``step`` still has its manifest (retention deletes the manifest first)."""
    try:
        return bool(backend.exists(f"{checkpoint_name(step)}/{MANIFEST_NAME}"))
    except MpckptError:
        return True  # cannot tell: report the original error


def restore(view: View, state: Any, *, step: int | None = None, fallback: bool = False, strict: bool = True,
            allow_pickle: bool = False, stats: Any = None) -> int | None:
    """Load the newest committed state checkpoint (or ``step``) into ``state`` in place: the
    step restored, or None when there is none (see ``Checkpointer.restore``).

    A single process reads a checkpoint one process saved straight into the live tensors
    where it can (``whole``, ``live``): the bytes land before their checksum is known, so a read
    that fails after that has changed the state. The next source or older step (``fallback``)
    then overwrites every leaf again; when none reads, the error says that the state is
    undefined (``state_changed``). Everything else is read into fresh tensors and applied.

    In a job each rank reads the byte ranges it needs (resharding): optimizers over DTensors
    without state yet get theirs first (as an optimizer step with zero gradients and learning
    rate 0 would make it), so that their moments are restored as shards like the parameters;
    an optimizer over plain tensors (DDP) takes its moments as loaded, as in one process.
    """
    started = time.perf_counter()
    url = view.backend.url
    group = view.group
    live: list[dict[str, Any]] = []  # a job's live DTensors by leaf name, found at the first read
    flat: list[Any] = []  # a single process's live state flattened, at the first read
    changed: list[BaseException] = []  # the errors of reads that had written into live tensors

    def live_flat() -> Any:
        if not flat:
            flat.append(_flat_live(state, allow_pickle))
        return flat[0]

    def targets() -> dict[str, Any]:
        if not live:
            from mpckpt._codec.snapshot import flatten

            init_optimizer_state(state)
            flat = flatten(state, allow_pickle=allow_pickle, distributed=True)
            assert flat.dist is not None
            live.append({flat.leaves[i].name: shard for i, shard in flat.dist.shards.items()})
        return live[0]

    def read_and_apply(source: Source) -> int:
        manifest = source.manifest
        if group.alone:  # the live state is this process's whole state: read into it where it can
            loaded = _load_in_place(source, live_flat, allow_pickle=allow_pickle, strict=strict, changed=changed)
            read = sum(e.size for e in manifest.files.values())
        elif manifest.ranked:
            loaded, read = load_ranked_for(source, rank=group.rank, world_size=group.world_size, targets=targets(),
                                           strict=strict, allow_pickle=allow_pickle)
        else:  # saved by one process: every rank reads it whole and keeps its shards
            loaded = shard_like_live(load_state(source, allow_pickle=allow_pickle), targets())
            read = sum(e.size for e in manifest.files.values())
        apply_state(state, loaded, strict=strict, source=f"step {manifest.step} of {url}")
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # copies to a GPU went up asynchronously: restored means there
        return read

    try:
        found = read_newest(view, read_and_apply, step=step, fallback=fallback)
    except MpckptError as e:
        _undefined(e, changed)
        done = getattr(view, "done_reading", None)  # every rank failed alike: stop serving other nodes
        if done is not None:
            done()
        raise  # what was found in memory stays there (``Keeper.close``)
    settle = getattr(view, "restored", None)  # a writer takes over (or drops) what it found in memory
    if settle is not None:
        settle(found[0] if found is not None else None)
    if found is None:
        log.info("mpckpt: no checkpoint in %s: starting fresh", url)
        if stats is not None:
            stats.last_restore = None
        return None
    restored, read, source, skipped = found
    if stats is not None:
        stats.restored_bytes = read
        stats.last_restore = LastRestore(restored, source.kind, time.perf_counter() - started, read)
    aside = sorted({*skipped, *(s for s in view.damaged if s > restored)}) if fallback else []
    if aside and not view.read_only:  # the run goes on from here: those steps are saved again
        view.set_aside(aside, move=group.rank == 0)
        group.all_gather(None)  # rank 0 moved them; every rank goes on after
    log.info("mpckpt: restored step %d of %s from %s (%.2f s)", restored, url, source.kind,
             time.perf_counter() - started)
    return restored


_UNDEFINED = ("Bytes of a checkpoint that does not verify went into the live tensors before that was known: they "
              "are partly overwritten, the state is undefined. Restore an intact step (restore(state, fallback=True) "
              "finds the newest) or rebuild the state before training on")


def _flat_live(state: Any, allow_pickle: bool) -> Any:
    """The live state flattened as a save does (``FlatState``: views of its tensors' memory), or
    None when it does not flatten: reading in place only saves time, every leaf is then read fresh."""
    from mpckpt._codec.snapshot import flatten

    try:
        return flatten(state, allow_pickle=allow_pickle)
    except Exception as e:  # a value a save refuses, a state_dict() that fails: not this restore's business
        log.debug("mpckpt: every leaf is read fresh: the live state does not flatten (%s: %s)", type(e).__name__, e)
        return None


def _load_in_place(source: Source, live: Callable[[], Any], *, allow_pickle: bool, strict: bool,
                   changed: list[BaseException]) -> Any:
    """A single process's load of ``source`` for a restore: a checkpoint one process saved is read
    into the live tensors where ``whole`` can (``live()``: the live state flattened, or None).
    A read that fails after writing into them is noted in ``changed``."""
    manifest = source.manifest
    if manifest.ranked or manifest.kind != "state":
        return load_state(source, allow_pickle=allow_pickle)
    try:
        loaded = load_whole(source, allow_pickle=allow_pickle, live=live())
    except BaseException as e:
        if getattr(e, "state_changed", False):
            changed.append(e)
        raise
    if changed and not strict:
        log.warning("mpckpt: a checkpoint that did not verify was partly read into the live tensors before %s was "
                    "read; with strict=False, tensors that %s does not hold may keep its bytes", source.name,
                    source.name)
    return loaded


def _undefined(e: MpckptError, changed: list[BaseException]) -> None:
    """When a read went into the live tensors before it failed (``changed``), make ``e`` say that
    the state is undefined (raised as a new error for a ``CorruptCheckpointError``, a note otherwise)."""
    if not changed or (getattr(e, "state_changed", False) and all(e is not c for c in changed)):
        return  # nothing went into live tensors, or whoever made ``e`` said it
    if isinstance(e, CorruptCheckpointError):
        text = str(e).removesuffix(". The live state was not changed")  # (``_explained``'s: true of fresh reads)
        said = type(e)(f"{text}. {_UNDEFINED}", path=e.path)
        said.state_changed = True  # type: ignore[attr-defined]
        raise said from e
    add_note(e, f"mpckpt: {_UNDEFINED}")
    e.state_changed = True  # type: ignore[attr-defined]
