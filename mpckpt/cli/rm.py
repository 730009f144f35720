"""``mpckpt rm ROOT STEP [STEP ...] [--damaged]``: delete checkpoints by hand; the others stay loadable.

It takes the writer lock, as ``gc`` does, so it never deletes beside a live trainer (that
process deletes with ``ckpt.delete(step)``); a held lock is an error naming its holder.
Everything is checked before anything is deleted, by the checks ``ckpt.delete`` makes
(``_commit.deletion.refuse``), and the command is refused as a whole ("nothing deleted: ",
status 2) for a step that is not there (the message lists those there are), a damaged one
without ``--damaged`` (damaged checkpoints are otherwise never deleted: they may be
recoverable), and a folder that a checkpoint staying behind reads files from (roots written
before shared files; delete that one with it). The newest checkpoint may be deleted too.

Then each folder goes, newest first (``deletion.newest_first``) and manifest first (a reader
never finds one half deleted), and last the files in ``shared/`` that no checkpoint lists any
more, as ``gc`` removes them (``_commit.shared``): a frozen shard another checkpoint lists
stays. A deletion that fails is status 1, and its shared files are kept for the next ``rm``
or ``gc``.
"""

from __future__ import annotations

import argparse
import os

from mpckpt._commit.deletion import Asker, newest_first, refuse
from mpckpt._commit.shared import collect_orphans
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
    asker = Asker("--damaged", there=steps_there, command=f"mpckpt rm {root}")
    try:  # the writer lock is held: nothing is pending or being validated
        refuse(steps, committed, problems, url=backend.url, allow_damaged=damaged, asker=asker)
    except MpckptError as e:
        raise BadArguments(f"nothing deleted: {e}") from e
    failed = False
    for step in newest_first(steps):
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
