"""Opening a root with every rank of a job (a collective, on the training thread).

Rank 0 alone takes the root's writer lock and runs the recovery scan (``catalog.recover``:
staging folders and manifest-less checkpoints a crashed run left are removed, which is safe
because no rank of this job has written anything yet), then broadcasts what it found and a
fresh *run token*. Every rank starts from the same committed checkpoints, writes into the
staging folder the token names (``Backend.staging_name(name, run=token)``) and talks to the
others under a store prefix the token names, so a restarted job (the same ranks, new pids)
never mixes with what an earlier attempt left. The other ranks never clean anything: a
folder that another live rank is still writing is never removed as "crashed".

If rank 0 cannot open (the root is locked by another job, storage fails), every rank gets
the same error instead of waiting in the broadcast. Every rank must see the same storage: rank
0 writes a probe file (``.mpckpt-probe``) before the broadcast and every rank looks for it, so a
local path that is not one shared filesystem on every machine of the job is refused at open,
on every rank, naming the ranks that cannot see it, instead of a manifest listing files that
are elsewhere.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mpckpt import errors
from mpckpt._dist.group import RankGroup
from mpckpt.catalog import Recovered, recover
from mpckpt.format.manifest import Manifest
from mpckpt.storage import Backend

PROBE_NAME = ".mpckpt-probe"


@dataclass
class RankedOpen:
    token: str
    committed: dict[int, Manifest]
    damaged: dict[int, Exception] = field(default_factory=dict)
    lock: Any = None  # rank 0's writer lock


def open_ranked(group: RankGroup, backend: Backend, take_lock: Callable[[], Any]) -> RankedOpen:
    """Rank 0 locks and recovers, every rank learns the outcome (see the module's docstring)."""
    if group.rank == 0:
        lock = None
        try:
            lock = take_lock()
            found: Recovered = recover(backend)
            token = secrets.token_hex(8)
            backend.write_file(PROBE_NAME, [token.encode()])
            payload: Any = ("ok", token, found.committed, {s: str(e) for s, e in found.damaged.items()})
        except BaseException as e:
            group.broadcast(("error", type(e).__name__, str(e)))
            if lock is not None:
                lock.release()
            raise
        group.broadcast(payload)
        try:
            _same_storage(group, backend, token)
        except BaseException:
            lock.release()
            raise
        return RankedOpen(token, found.committed, dict(found.damaged), lock)
    payload = group.broadcast(None)
    if payload[0] == "error":
        _, kind, message = payload
        cls = getattr(errors, kind, None)
        if not (isinstance(cls, type) and issubclass(cls, errors.MpckptError)):
            cls = errors.StorageError
        raise cls(f"rank 0 could not open {backend.url}: {message}")
    _, token, committed, damaged = payload
    _same_storage(group, backend, token)
    return RankedOpen(token, committed, {s: errors.CorruptCheckpointError(m) for s, m in damaged.items()})


def _same_storage(group: RankGroup, backend: Backend, token: str) -> None:
    """Every rank reads the probe rank 0 wrote, or every rank raises (a collective)."""
    try:
        seen = backend.read_bytes(PROBE_NAME, max_bytes=64) == token.encode()
    except errors.MpckptError:
        seen = False
    blind = [rank for rank, ok in enumerate(group.all_gather(seen)) if not ok]
    if group.rank == 0:
        try:
            backend.delete_file(PROBE_NAME)
        except errors.MpckptError:
            pass
    if blind:
        raise errors.ConfigError(
            f"rank{'s' if len(blind) > 1 else ''} {', '.join(map(str, blind))} cannot see the files rank 0 writes "
            f"under {backend.url}: every rank of a job must write to the same storage (on several machines, a "
            "local path must be one shared filesystem; or use an object store)")
