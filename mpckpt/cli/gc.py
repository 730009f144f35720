"""``mpckpt gc [ROOT ...]``: remove what dead trainers left behind.

Shared memory of dead trainers first (segments without an owner file are left alone and
named: only root in the host's PID namespace can tell whether they are in use). Snapshots this
user's trainers kept in memory (``keep_in_memory``), and the copies this node holds of other
nodes' snapshots (``peer_copies``): those of a ROOT given that no live process
keeps any more are removed, each named with its rank, step and size (a restart of that run would
have restored from one; with it gone, the restart reads storage), and so are ROOT's kept files
whose record is missing or unreadable (an interrupted keep: the root is known from the key in
their names); without a ROOT every kept snapshot is listed, with the command that would remove
it, and none is removed (a crashed trainer may be about to restart from it). Then, under
each ROOT, staging and manifest-less folders and the files in ``shared/`` no manifest lists
(a crashed save's, or those of checkpoints removed by hand), by the same ``catalog.recover``
that opening a Checkpointer runs. It takes the writer lock, so it refuses while a live trainer writes there.
A local folder no Checkpointer has used (no writer lock, checkpoint or staging folder in it:
a wrong ROOT, such as the folder above the roots) is refused, status 1, naming the checkpoint
roots below it, and nothing in it is touched.

INVARIANT: a folder with a manifest is never removed, damaged or not.
"""

from __future__ import annotations

import argparse
import os

from mpckpt._keep import store as _kept
from mpckpt._system import shm as _shm
from mpckpt.catalog import recover
from mpckpt.cli._common import backend_for, complain, say
from mpckpt.cli._roots import no_checkpoint, written_by_mpckpt
from mpckpt.errors import MpckptError


class NotARoot(MpckptError):
    """A folder no Checkpointer has used, given to gc: status 1, nothing touched."""


def run(args: argparse.Namespace) -> int:
    undecided: list[str] = []
    for name in _shm.reap_orphans(undecided=undecided):
        say(f"removed orphaned shared memory {name}")
    for name in undecided:
        complain(f"left shared memory {name} alone: it has no owner file (an mpckpt before owner files made it), "
                 "and only root in the host's PID namespace can see whether a process still uses it; run "
                 "`mpckpt gc` there, or remove it by hand once no trainer of an older mpckpt runs")
    _gc_kept(args.roots, args.storage_options)
    status = 0
    for root in args.roots:
        try:
            status |= _gc_root(root, args.storage_options)
        except MpckptError as e:
            complain(f"{root}: {e}")
            status = 1
    return status


def _gc_kept(roots: list[str], options: str | None) -> None:
    """Without ``roots``: list this user's kept snapshots, remove none. With them: remove those of
    ``roots`` no live process keeps, an incomplete one (its record missing or unreadable: an
    interrupted keep, a lock left alone) too; a snapshot belongs to a root by the key its file
    names carry, so an incomplete one is known to be ROOT's without its record."""
    keys = set()
    for root in roots:
        try:
            keys.add(_kept.root_key(str(backend_for(root, options).url)))
        except MpckptError:
            continue  # said when the root itself is collected
    for kept in _kept.list_kept():
        given = _kept.root_key_of(kept.base) in keys
        if roots and not given:
            continue  # another root's (or ROOT could not be opened): gc ROOT speaks of ROOT's only
        whose = "the copy held for another node of" if kept.peer else "the snapshot of"
        what = (f"{whose} step {kept.step} of {kept.root} (rank {kept.rank})" if kept.root is not None
                else f"the incomplete snapshot {kept.base} (rank {kept.rank})")
        size = f"{kept.nbytes >> 20} MiB"
        if kept.held:
            say(f"left {what} kept in memory ({size}): a live trainer keeps it")
        elif not given and kept.root is not None:
            say(f"left {what} kept in memory ({size}): its trainer may restart from it; `mpckpt gc {kept.root}` "
                "removes it")
        elif not given:
            say(f"left {what} in memory ({size}): its record is missing or unreadable; `mpckpt gc ROOT` of the "
                f"root it was kept for removes it (or remove /dev/shm/{kept.base}* by hand)")
        elif _kept.remove_kept(kept.base):
            say(f"removed {what} kept in memory ({size}): no trainer keeps it any more")


def _gc_root(root: str, options: str | None) -> int:
    backend = backend_for(root, options)
    folder = str(backend.url)
    if os.path.isabs(folder) and os.path.isdir(folder) and not written_by_mpckpt(folder):
        # a wrong ROOT: its shared/ may be someone's files, and no lock file is left behind
        raise NotARoot(f"nothing removed: {no_checkpoint(folder)}")
    lock = backend.acquire_writer_lock(f"mpckpt gc pid {os.getpid()}")
    try:
        found = recover(backend)  # what opening a Checkpointer there would do
    finally:
        lock.release()
    for name in found.removed_staging:
        say(f"{root}: removed staging folder {name}")
    for name in found.removed_incomplete:
        say(f"{root}: removed incomplete checkpoint {name}")
    for path in found.removed_shared:
        say(f"{root}: removed shared file {path}: no checkpoint uses it")
    for step in sorted(found.damaged):
        complain(f"{root}: kept damaged step {step} (never deleted: it may be recoverable): {found.damaged[step]}")
    return 0
