"""``mpckpt rm ROOT STEP [STEP ...] [--damaged]``: delete checkpoints by hand; the others stay loadable.

It takes the writer lock, as ``gc`` does, so it never deletes beside a live trainer (that
process deletes with ``ckpt.delete(step)``); a held lock is an error naming its holder.
Everything is checked before anything is deleted, and the command is refused as a whole
(status 2) for a step that is not there (the message lists those there are), a damaged one
without ``--damaged`` (damaged checkpoints are otherwise never deleted: they may be
recoverable), and a folder that a checkpoint staying behind reads files from (roots written
before shared files; delete that one with it). The newest checkpoint may be deleted too.

Then each folder goes, newest first and manifest first (a reader never finds one half
deleted), and last the files in ``shared/`` that no checkpoint lists any more, as ``gc``
removes them (``_commit.shared``): a frozen shard another checkpoint lists stays. A deletion
that fails is status 1, and its shared files are kept for the next ``rm`` or ``gc``.
"""

from __future__ import annotations

import argparse
import os

from mpckpt._commit.shared import collect_orphans, deletion_blockers
from mpckpt.cli._common import (
    BadArguments,
    backend_for,
    complain,
    no_checkpoint_text,
    say,
    scan_quietly,
    steps_there,
)
from mpckpt.errors import LockedError, MpckptError
from mpckpt.format.names import checkpoint_name, step_of
from mpckpt.storage import Backend


def run(args: argparse.Namespace) -> int:
    backend = backend_for(args.root, args.storage_options)
    if not any(step_of(name) is not None for name in backend.list_names()):  # before the lock: a wrong ROOT
        raise BadArguments(f"nothing deleted: {no_checkpoint_text(backend)}")  # keeps no lock file
    try:
        lock = backend.acquire_writer_lock(f"mpckpt rm pid {os.getpid()}")
    except LockedError as e:
        raise LockedError(f"nothing deleted: {e}. mpckpt rm never deletes beside a live writer; call "
                          "ckpt.delete(step) in that process, or run mpckpt rm once it has closed") from e
    try:
        return _remove(backend, args.root, sorted(set(args.steps)), damaged=args.damaged)
    finally:
        lock.release()


def _remove(backend: Backend, root: str, steps: list[int], *, damaged: bool) -> int:
    committed, problems = scan_quietly(backend)
    if not committed and not problems:
        raise BadArguments(f"nothing deleted: {no_checkpoint_text(backend)}")
    unknown = [s for s in steps if s not in committed and s not in problems]
    if unknown:
        raise BadArguments(f"nothing deleted: no checkpoint of step {unknown[0]} in {backend.url}; "
                           f"{steps_there(committed)}")
    bad = [s for s in steps if s in problems]
    if bad and not damaged:
        raise BadArguments(f"nothing deleted: step {bad[0]} is damaged ({problems[bad[0]]}); damaged checkpoints "
                           "are kept since they may be recoverable: pass --damaged to delete it")
    blockers = deletion_blockers(committed, steps)
    if blockers:
        step, users = min(blockers.items())
        raise BadArguments(f"nothing deleted: steps {users} read files in the folder of step {step} (written by an "
                           f"mpckpt before shared files); delete them with it (mpckpt rm {root} {step} "
                           f"{' '.join(map(str, users))}), or keep it")
    failed = False
    for step in reversed(steps):  # newest first: one that reads an older folder goes before it
        try:
            backend.delete(checkpoint_name(step))
        except MpckptError as e:
            complain(f"{root}: could not delete step {step}: {e}")
            failed = True
            continue
        say(f"{root}: deleted step {step}")
    if failed:  # INVARIANT: shared files only once no folder that may list them is left
        complain(f"{root}: shared files kept; run mpckpt rm or mpckpt gc again")
        return 1
    staying = {s: m for s, m in committed.items() if s not in steps}
    for path in collect_orphans(backend, staying, {s: e for s, e in problems.items() if s not in steps}):
        say(f"{root}: removed shared file {path}: no checkpoint uses it")
    return 0
