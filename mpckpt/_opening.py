"""Opening a root: the rules that decide what a Checkpointer holds.

``open_root`` takes the checked configuration and the root, and gives back what the facade
keeps. Read-only, it opens a ``_view.StorageView`` and refuses every option that writes
(retention, a trigger, preemption signals, ``validate=``). Writing, it refuses what a job of
several ranks cannot do (a root in this process's memory, ``validate=``), checks that the root
is writable, fits the memory budget to the free space of /dev/shm, and opens the ``Runtime``
(the writer lock, named by the process or by the torchrun job; uploaders; shared memory),
with a finalizer that lets go of it when the Checkpointer is dropped unclosed: the runtime
never refers back to the Checkpointer, so an unreferenced one can be collected.
"""

from __future__ import annotations

import os
import socket
import traceback
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mpckpt._dist.group import RankGroup
from mpckpt._preemption import PreemptionWatch, parse_signals
from mpckpt._runtime import Runtime
from mpckpt._view import StorageView
from mpckpt.config import Config, fit_budget_to_shm
from mpckpt.errors import ConfigError
from mpckpt.storage import BackendSpec, open_backend, spec_for_url


@dataclass(frozen=True)
class Opened:
    """What the Checkpointer keeps of an opened root."""

    config: Config  # writing: with the memory budget fitted to /dev/shm
    spec: BackendSpec
    runtime: Runtime | StorageView
    finalizer: weakref.finalize[Any, Any] | None  # None when read-only: nothing to let go of


def open_root(owner: object, root: str | os.PathLike[str], config: Config, *,
              storage_options: Mapping[str, Any] | None, read_only: Any) -> Opened:
    """Open ``root`` for ``owner`` (the Checkpointer, which the finalizer watches) with the
    settings of ``config``; a read-only open refuses those that write (none has a variable, so
    any that is set was given).
    """
    signals = parse_signals(config.preemption)
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
    if group is not None and group.world_size > 1 and getattr(backend, "process_local", False):
        raise ConfigError(f"{backend.url} lives in this process's memory, where the other ranks of the job cannot "
                          "see it; give a multi-rank job a root every rank reaches (a shared path, s3://, az://)")
    if group is not None and config.validate is not None:
        raise ConfigError("validate= is not available in a multi-rank job yet; validate the committed checkpoints "
                          "from one process (mpckpt.load(root) gives the whole state), or save from one process")
    backend.check_writable()
    config = fit_budget_to_shm(config)
    runtime = Runtime(config, spec, backend, environ=dict(os.environ), owner=_lock_owner(group),
                      where=caller_location(), pin=_cuda_available(), preemption=PreemptionWatch(signals),
                      group=group)
    finalizer = weakref.finalize(owner, runtime.release_unclosed)  # the atexit side is the runtime's
    finalizer.atexit = False
    return Opened(config, spec, runtime, finalizer)


def caller_location() -> str:
    """``file:line`` of the first frame outside mpckpt (where the user opened the Checkpointer)."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    for frame in reversed(traceback.extract_stack()):
        if not os.path.abspath(frame.filename).startswith(package):
            return f"{frame.filename}:{frame.lineno}"
    return "<unknown>"


def _lock_owner(group: RankGroup | None) -> str:
    """Who holds the root's writer lock, as the lock records it.

    A job that torchrun restarts (``--max-restarts``) opens the root again from new
    processes while the lease of the attempt that died may still be valid on an object
    store: its rank 0 then names itself by the job (the run id and the rendezvous endpoint,
    the same for every attempt of one job and different for any other job), and a lease of
    the same owner is taken over. Anywhere else the owner is the process.
    """
    env = os.environ
    if group is not None and "TORCHELASTIC_RUN_ID" in env and "MASTER_ADDR" in env:
        return (f"rank 0 of torchrun job {env['TORCHELASTIC_RUN_ID']} at {env['MASTER_ADDR']}:"
                f"{env.get('MASTER_PORT', '')} on {socket.gethostname()}")
    return f"pid {os.getpid()} on {socket.gethostname()}"


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
