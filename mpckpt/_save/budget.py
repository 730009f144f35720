"""Taking shared memory for a save under the memory budget and its policy.

A save needs one slab per wave of its layout. The first is taken before anything is copied:
if the budget has room, at once (and, for a one-wave state, once the copy is done, a spare slab
is made in the background for the next save, while this one uploads: ``spare_for``). If not,
the policy decides:

* ``block``: wait for uploads to free memory, bounded by ``timeout_s``, raising unseen
  background failures while waiting (a failed upload frees nothing the save waits for);
* ``skip``: take nothing; the caller records the save as skipped;
* ``coalesce``: drop the newest pending checkpoint none of whose uploads has started (its
  slab comes back), then take; if there is none, wait as ``block`` does.

Later waves of a state larger than the budget always wait for the previous wave's uploads.

Staging folders are the commit side's: a coalesced checkpoint's folder is removed through the
``abort_staging`` the runtime hands in; nothing here touches storage.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mpckpt._ledger import Ledger
from mpckpt._stage.arena import Arena, Slab
from mpckpt._stage.layout import Layout
from mpckpt._upload.pool import UploaderPool
from mpckpt.config import BudgetPolicy, Config


@dataclass(eq=False)
class Budget:
    """Slabs for saves of one checkpointer, under its memory budget and policy."""

    config: Config
    arena: Arena
    ledger: Ledger
    pool: UploaderPool
    on_wait: Callable[[], None]  # called while waiting for memory: raises unseen background failures
    # removes a coalesced checkpoint's staging folder; None when it is not this process's to
    # remove (in a multi-rank job the folder is every rank's: the coordinator removes it once
    # the step is dropped)
    abort_staging: Callable[[str], None] | None = None

    def take_first(self, layout: Layout) -> Slab | None:
        """The slab of the first wave, or None when the policy is ``skip`` and the budget is full."""
        need = layout.waves[0].nbytes
        slab = self.arena.try_acquire(need)
        if slab is not None:
            return slab
        policy = self.config.policy
        if policy is BudgetPolicy.SKIP:
            return None
        if policy is BudgetPolicy.COALESCE:
            self._coalesce_one()
            slab = self.arena.try_acquire(need)
            if slab is not None:
                return slab
        return self.take(need)

    def spare_for(self, layout: Layout) -> None:
        """After a save's copy (not during it, which it would slow down): have a free slab made in
        the background for the next save of a one-wave state, while this one uploads."""
        if len(layout.waves) == 1:
            self.arena.ensure_spare(layout.waves[0].nbytes)

    def take(self, nbytes: int) -> Slab:
        """A slab of ``nbytes``, waiting for uploads to free memory (bounded)."""
        return self.arena.acquire(nbytes, timeout_s=self.config.timeout_s, on_wait=self.on_wait)

    def release(self, slab: Slab) -> None:
        self.arena.release(slab)

    def _coalesce_one(self) -> None:
        """Drop the newest pending checkpoint none of whose uploads has started."""
        for record in reversed(self.ledger.pending()):
            if record.kind != "state" or record.outcome is not None or not record.submitted_all:
                continue
            if self.pool.cancel(record.seq):
                for slab in self.ledger.drop(record, "coalesced"):
                    self.arena.release(slab)
                if self.abort_staging is not None:
                    self.abort_staging(record.staging)
                return
