"""Opening a root: the rules that decide what a Checkpointer holds, and taking the root.

``open_root`` takes the checked configuration and the root, and gives back what the facade
keeps. Read-only, it opens a ``_view.StorageView`` and refuses every option that writes
(retention, a trigger, preemption signals, ``validate=``). Writing, it refuses what a job of
several ranks cannot do (a root in this process's memory, ``validate=``), checks that the root
is writable, fits the memory budget to the free space of /dev/shm, takes the root
(``take_root``) and opens the ``Runtime`` (uploaders, shared memory, the commit), with a
finalizer that lets go of it when the Checkpointer is dropped unclosed: the runtime never
refers back to the Checkpointer, so an unreferenced one can be collected.

``take_root`` is one path for one process or a job (a collective, on the training thread; a
single process is a group of one, ``_dist.group``): rank 0 alone takes the root's writer lock
(named by the process, or by the torchrun job: ``_lock_owner``) and runs the recovery scan
(``catalog.recover``: staging folders and manifest-less checkpoints a crashed run left are
removed, which is safe because no rank of this job has written anything yet), then broadcasts
what it found and, in a job, a fresh *run token*. Every rank starts from the same committed
checkpoints, writes into the staging folder the token names (``Backend.staging_name(name,
run=token)``) and talks to the others under a store prefix the token names, so a restarted job
(the same ranks, new pids) never mixes with what an earlier attempt left. The other ranks never
clean anything: a folder that another live rank is still writing is never removed as "crashed".
A single process needs no token: its staging folders are its own, a fresh one per save.

If rank 0 cannot open (the root is locked by another job, storage fails), every rank gets the
same error instead of waiting in the broadcast. Every rank must see the same storage: in a job
of several ranks, rank 0 writes a probe file (``.mpckpt-probe``) before the broadcast and every
rank looks for it, so a local path that is not one shared filesystem on every machine of the
job is refused at open, on every rank, naming the ranks that cannot see it, instead of a
manifest listing files that are elsewhere.
"""

from __future__ import annotations

import os
import secrets
import socket
import traceback
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from mpckpt import errors
from mpckpt._dist.group import RankGroup
from mpckpt._preemption import PreemptionWatch, parse_signals
from mpckpt._runtime import Runtime, Taken
from mpckpt._view import StorageView
from mpckpt._writer_lock import acquire_writer_lock
from mpckpt.catalog import Recovered, recover
from mpckpt.config import Config, fit_budget_to_shm
from mpckpt.errors import ConfigError
from mpckpt.storage import Backend, BackendSpec, open_backend, spec_for_url

PROBE_NAME = ".mpckpt-probe"


@dataclass(frozen=True)
class Opened:
    """What the Checkpointer keeps of an opened root."""

    config: Config  # writing: with the memory budget fitted to /dev/shm
    spec: BackendSpec
    runtime: Runtime | StorageView
    finalizer: weakref.finalize[Any, Any] | None  # None when read-only: nothing to let go of


def open_root(owner: object, root: str | os.PathLike[str], config: Config, *,
              storage_options: Mapping[str, Any] | None, read_only: Any, spec: BackendSpec | None = None) -> Opened:
    """Open ``root`` for ``owner`` (the Checkpointer, which the finalizer watches) with the
    settings of ``config``; a read-only open refuses those that write (none has a variable, so
    any that is set was given). ``spec``: the backend of an earlier open of the same root (a
    heal opens it again: ``healing``), in place of ``root`` and ``storage_options``.
    """
    signals = parse_signals(config.preemption)
    if spec is None:
        spec = spec_for_url(root, dict(storage_options or {}), direct_io=config.direct_io)
    backend = open_backend(spec)
    if read_only is True:
        options = {"keep": config.keep, "keep_last": config.keep_last, "trigger": config.trigger,
                   "preemption": signals or None, "validate": config.validate}
        given = [name for name, value in options.items() if value is not None]
        if given:
            raise ConfigError(f"read_only=True with {', '.join(given)}: a read-only Checkpointer never saves "
                              "or deletes; leave those to the Checkpointer that writes")
        return Opened(config, spec, StorageView(backend, config.timeout_s), None)
    if read_only is not False:
        raise ConfigError(f"read_only={read_only!r} must be True or False")
    group = RankGroup.detect(config.process_group)
    if group.world_size > 1 and getattr(backend, "process_local", False):
        raise ConfigError(f"{backend.url} lives in this process's memory, where the other ranks of the job cannot "
                          "see it; give a multi-rank job a root every rank reaches (a shared path, s3://, az://)")
    if not group.alone and config.validate is not None:
        raise ConfigError("validate= is not available in a multi-rank job yet; validate the committed checkpoints "
                          "from one process (mpckpt.load(root) gives the whole state), or save from one process")
    backend.check_writable()
    config = fit_budget_to_shm(config)
    validation = None
    if config.validate is not None:  # imported when used, not at every open; refused before anything starts
        from mpckpt._commit.validation import prepare as prepare_validation
        validation = prepare_validation(config.validate, backend)
    holder, where = _lock_owner(group), caller_location()
    taken = take_root(group, backend, lambda: acquire_writer_lock(backend, holder, where))
    runtime = Runtime(config, spec, backend, environ=dict(os.environ), pin=_cuda_available(),
                      preemption=PreemptionWatch(signals), group=group, taken=taken, validation=validation)
    finalizer = weakref.finalize(owner, runtime.release_unclosed)  # the atexit side is the runtime's
    finalizer.atexit = False
    return Opened(config, spec, runtime, finalizer)


def take_root(group: RankGroup, backend: Backend, take_lock: Callable[[], Any]) -> Taken:
    """Rank 0 locks and recovers, every rank learns the outcome (see the module's docstring)."""
    if group.rank == 0:
        lock = None
        try:
            lock = take_lock()
            found: Recovered = recover(backend)
            token = None if group.alone else secrets.token_hex(8)  # a job's ranks share staging and keys by it
            if group.world_size > 1:
                backend.write_file(PROBE_NAME, [str(token).encode()])
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
        return Taken(token, found.committed, dict(found.damaged), lock)
    payload = group.broadcast(None)
    if payload[0] == "error":
        _, kind, message = payload
        cls = getattr(errors, kind, None)
        if not (isinstance(cls, type) and issubclass(cls, errors.MpckptError)):
            cls = errors.StorageError
        raise cls(f"rank 0 could not open {backend.url}: {message}")
    _, token, committed, damaged = payload
    _same_storage(group, backend, token)
    return Taken(token, committed, {s: errors.CorruptCheckpointError(m) for s, m in damaged.items()})


def _same_storage(group: RankGroup, backend: Backend, token: str | None) -> None:
    """Every rank reads the probe rank 0 wrote, or every rank raises (a collective; one rank
    sees what it writes: nothing to check)."""
    if group.world_size == 1:
        return
    try:
        seen = backend.read_bytes(PROBE_NAME, max_bytes=64) == str(token).encode()
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


def caller_location() -> str:
    """``file:line`` of the first frame outside mpckpt (where the user opened the Checkpointer)."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    for frame in reversed(traceback.extract_stack()):
        if not os.path.abspath(frame.filename).startswith(package):
            return f"{frame.filename}:{frame.lineno}"
    return "<unknown>"


def _lock_owner(group: RankGroup) -> str:
    """Who holds the root's writer lock, as the lock records it.

    A job that torchrun restarts (``--max-restarts``) opens the root again from new
    processes while the lease of the attempt that died may still be valid on an object
    store: its rank 0 then names itself by the job (the run id and the rendezvous endpoint,
    the same for every attempt of one job and different for any other job), and a lease of
    the same owner is taken over. Anywhere else the owner is the process.
    """
    env = os.environ
    if not group.alone and "TORCHELASTIC_RUN_ID" in env and "MASTER_ADDR" in env:
        return (f"rank 0 of torchrun job {env['TORCHELASTIC_RUN_ID']} at {env['MASTER_ADDR']}:"
                f"{env.get('MASTER_PORT', '')} on {socket.gethostname()}")
    return f"pid {os.getpid()} on {socket.gethostname()}"


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
