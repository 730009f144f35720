"""Deleting checkpoints on request, and the refusals that come first: the one home of both,
used by ``Checkpointer.delete`` and ``mpckpt rm``.

``refuse`` checks a requested deletion against what is committed and damaged and raises on the
first problem, in this order: a step that is not there (``CheckpointNotFoundError``), a damaged
one unless allowed (``ConfigError``: damaged checkpoints are kept, they may be recoverable); for
a live writer only, the newest while saves are pending and one being validated
(``StepOrderError``: wait first); and a folder that a checkpoint staying behind reads files from
(``ConfigError``; roots written before shared files, see ``shared.deletion_blockers``). The
wording lives here once: a caller says how its user asks for things (``Asker``: ``damaged=True``
or ``--damaged``, the command line that deletes) and adds its own frame (``mpckpt rm``: "nothing
deleted: " and exit status 2).

``Deletions`` is what a live writer (``Runtime``) does to let checkpoints go outside retention:
``delete`` (``Checkpointer.delete``), ``discard_after`` (``discard_newer``, a restore going
back), ``set_aside`` (damaged checkpoints a restore skipped, moved, never deleted) and
``forget_deleted`` (checkpoints someone else deleted). Invariants: a deletion is refused as a
whole before anything is deleted; every checkpoint is forgotten (ledger, frozen shards) before
its folder goes, so nothing new references it; folders go newest first (``newest_first``: one
that reads files in an older folder goes before it), each with its manifest first (the
backend's ``delete``); shared files go last, once no folder that lists them is left.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from mpckpt._commit.shared import deletion_blockers
from mpckpt.errors import CheckpointNotFoundError, ConfigError, StepOrderError
from mpckpt.format.manifest import MANIFEST_NAME, Manifest
from mpckpt.format.names import ASIDE_PREFIX, SUPERSEDED_PREFIX, aside_name, checkpoint_name
from mpckpt.storage import Backend

if TYPE_CHECKING:
    from mpckpt._commit.deleter import Deleter
    from mpckpt._commit.validation import Validator
    from mpckpt._ledger import Ledger

log = logging.getLogger("mpckpt")


@dataclass(frozen=True)
class Asker:
    """Who asks for a deletion, in the words its user types: what a refusal suggests."""

    allow_damaged: str  # how to delete damaged checkpoints anyway: "damaged=True", "--damaged"
    there: Callable[[Iterable[int]], str]  # the committed steps, told after "no checkpoint of step N"
    command: str | None = None  # the command line that deletes ("mpckpt rm ROOT"), suggested with steps


LIBRARY = Asker("damaged=True", there=lambda steps: f"committed steps: {sorted(steps)[-20:]}")


def refuse(steps: Collection[int], committed: Mapping[int, Manifest], damaged: Mapping[int, object], *,
           url: str, allow_damaged: bool, asker: Asker, pending_newest: int | None = None,
           validating: Collection[int] = ()) -> None:
    """Raise on the first reason not to delete ``steps`` (see the module docstring); else nothing.

    ``pending_newest`` (a live writer while saves are pending): the newest committed step, which
    may not go then; ``validating``: steps whose validation is queued or running.
    """
    unknown = sorted(s for s in steps if s not in committed and s not in damaged)
    if unknown:
        raise CheckpointNotFoundError(f"no checkpoint of step {unknown[0]} in {url}; {asker.there(committed)}")
    bad = sorted(s for s in steps if s in damaged)
    if bad and not allow_damaged:
        raise ConfigError(f"the checkpoints of steps {bad} in {url} are damaged (step {bad[0]}: {damaged[bad[0]]}), "
                          "and mpckpt keeps them since they may be recoverable (mpckpt verify says why); pass "
                          f"{asker.allow_damaged} to delete them")
    if pending_newest is not None and pending_newest in steps:
        raise StepOrderError(f"step {pending_newest} is the newest checkpoint and saves are still pending; wait() "
                             "for them before deleting it")
    busy = sorted(set(steps) & set(validating))
    if busy:
        raise StepOrderError(f"the checkpoints of steps {busy} are being validated (validate=); wait() for their "
                             "validations before deleting them")
    blockers = deletion_blockers(committed, steps)
    if blockers:
        step, users = min(blockers.items())
        together = "" if asker.command is None else f" ({asker.command} {step} {' '.join(map(str, users))})"
        raise ConfigError(f"the checkpoints of steps {users} read files in the folder of step {step} (written by an "
                          f"mpckpt before shared files); delete them with it{together}, or keep it")


def newest_first(steps: Iterable[int]) -> list[int]:
    """The order folders are deleted in: one that reads files in an older folder goes before it."""
    return sorted(set(steps), reverse=True)


class Frozen(Protocol):
    """The frozen shards later saves may list (``_stage.reuse.FrozenShards``)."""

    def forget_folder(self, name: str) -> None: ...

    def let_go(self, deleted: Iterable[Manifest]) -> list[str]: ...


@dataclass(eq=False)
class Deletions:
    """A live writer's deletions outside retention; built by ``Runtime``, which delegates to it."""

    ledger: Ledger
    backend: Backend
    frozen: Frozen
    deleter: Deleter
    retention_lock: threading.Lock  # the committer's: one decision at a time
    validator: Validator | None
    damaged: dict[int, Exception]  # the runtime's own dict: entries deleted or set aside leave it
    timeout_s: float
    wait: Callable[[float], None]  # for pending saves, validations and deletions (``Runtime.wait``)
    raise_unseen: Callable[[], None]  # background failures nobody saw yet

    def set_aside(self, steps: list[int], *, move: bool = True, superseded: bool = False) -> list[str]:
        """Move the damaged checkpoints of ``steps`` (newer than the one a restore went back to)
        out of the way, whole, to ``damaged.step_<step>.<UTC time>``; return those names
        (``superseded``: intact ones a run going on from an older step went back past, to
        ``superseded.step_<step>.<UTC time>``).

        Nothing is deleted: what they hold stays for a look (and the shared files they list stay
        with them), but they are no longer checkpoints, so the run saves those steps again. In a
        job only rank 0 moves (``move``); every rank's ledger lets the steps go.
        """
        committed = self.ledger.committed()
        self.ledger.set_aside(steps)  # first: refused while saves are pending
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(3)
        prefix, what = (SUPERSEDED_PREFIX, "checkpoint") if superseded else (ASIDE_PREFIX, "damaged checkpoint")
        moved = []
        for step in sorted(steps, reverse=True):
            name, aside = checkpoint_name(step), aside_name(step, stamp, prefix=prefix)
            self.frozen.forget_folder(name)
            if step in committed:  # its shared files stay: the moved manifest lists them
                self.frozen.let_go([committed[step]])
            self.damaged.pop(step, None)
            if move:
                self.backend.set_aside(name, aside)
                log.warning("mpckpt: moved the %s of step %d to %s/%s (kept for a look; delete it when done); "
                            "step %d will be saved again", what, step, self.backend.url, aside, step)
            moved.append(aside)
        return moved

    def set_aside_after(self, step: int) -> list[int]:
        """Move the checkpoints newer than ``step`` aside, now, so saving goes on from it (intact
        ones as superseded, damaged ones as damaged); their steps."""
        self.wait(self.timeout_s)
        self.raise_unseen()
        damaged = sorted(s for s in self.damaged if s > step)
        intact = sorted(s for s in self.ledger.committed() if s > step and s not in self.damaged)
        if intact:
            self.set_aside(intact, superseded=True)
        if damaged:
            self.set_aside(damaged)
        return sorted(intact + damaged)

    def discard_after(self, step: int) -> list[int]:
        """Delete the committed checkpoints newer than ``step``, now, so saving goes on from it."""
        self.wait(self.timeout_s)
        self.raise_unseen()
        committed = self.ledger.committed()
        newer = self.ledger.discard_after(step)
        names = [checkpoint_name(s) for s in newer]
        for name in names:  # later checkpoints reference earlier files, never the reverse
            self.frozen.forget_folder(name)
        shared = self.frozen.let_go([committed[s] for s in newer if s in committed])
        if names:
            log.info("mpckpt: going on from step %d: deleting the newer checkpoints %s", step, newer)
            self.deleter.delete(names, shared=shared)
            self.deleter.drain(timeout_s=self.timeout_s)
        return newer

    def delete(self, steps: list[int], *, damaged: bool) -> None:
        """Delete these checkpoints now (see ``Checkpointer.delete``); refused as a whole or done."""
        committed = self.ledger.committed()
        refuse(steps, committed, self.damaged, url=self.backend.url, allow_damaged=damaged, asker=LIBRARY,
               pending_newest=self.ledger.latest_step() if self.ledger.pending() else None,
               validating=self.validator.in_flight() if self.validator is not None else ())
        going = sorted(s for s in steps if s in committed)
        names = [checkpoint_name(s) for s in newest_first(steps)]
        for name in names:
            self.frozen.forget_folder(name)
        self.ledger.forget(going)
        shared = self.frozen.let_go([committed[s] for s in going])
        for s in steps:
            self.damaged.pop(s, None)
        log.info("mpckpt: deleting the checkpoints of steps %s in %s", sorted(set(steps)), self.backend.url)
        for name in names:  # here, not on the deleter: a failure is the caller's to see
            self.backend.delete(name)
        for path in shared:  # INVARIANT: only once no folder that lists them is left
            self.backend.delete_file(path)

    def forget_deleted(self) -> list[int]:
        """Stop listing committed checkpoints whose manifest is gone from storage (deleted by
        someone else: a framework's retention, ``mpckpt rm``); the newest is always kept."""
        latest = self.ledger.latest_step()
        gone = [s for s in sorted(self.ledger.committed())
                if s != latest and not self.backend.exists(f"{checkpoint_name(s)}/{MANIFEST_NAME}")]
        if gone:
            with self.retention_lock:
                for step in gone:
                    self.frozen.forget_folder(checkpoint_name(step))
                self.ledger.forget(gone)
        return gone
