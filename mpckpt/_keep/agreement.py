"""Which of its kept snapshots a rank of a job holds: its newest, and the newest step every rank holds.

A job is never at one step when a rank fails: the others may have finished the step the dead
rank was in and kept it, while the dead rank kept only the step before. If each rank held only
its newest snapshot, no step would be held by every rank and the restart would go back to
storage. So a rank lets a kept snapshot go only once a newer step is known to be kept by every
rank ("agreed"), and holds (``to_hold``):

- its newest snapshot;
- the newest agreed step it holds, and every step newer than that (none agreed yet: all it holds);
- the steps other parts pin (``pinned``: the copy to other nodes being sent, and the newest step
  whose copies are in place for every rank: ``_peer.replicate``).

A rank lets step s go only when a newer step s' is agreed; every rank holds every step from the
newest agreed one it knows of; so at every moment some step is held by every rank, and after
any single failure (before, during or after a save, in the optimizer step, while the others
save the next step) the restore finds it (``_peer.inventory``).

Knowing it costs the training thread nothing, and no collective: after publishing step s's
record, a rank adds one to the job's counter of s (``kept/<s>``, in the job's store under this
open's prefix) on a thread of the keeper's, and reads there the counters of the steps it holds;
a counter at the world size is an agreed step (remembered: it stays agreed). A job whose ranks
save one step apart (a collective in every step, the usual case) holds two snapshots per rank
for a moment after each save, then one or two: at most one slab more than a single process,
counted in the memory budget. When the budget cannot hold it, the save that needs the memory
takes the oldest (``Keeper._reclaim``, with a warning when that was the agreed step: a failure
then may cost a restore from storage, as before); never more memory than the budget.

A single process agrees with itself: it holds its newest snapshot only.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

_KEEP_COUNTERS = 8  # rank 0 removes the counters of steps this far below the newest agreed one


def to_hold(steps: Iterable[int], agreed: Iterable[int], pinned: Iterable[int] = ()) -> set[int]:
    """Of the kept ``steps``, those a rank holds (see the module docstring)."""
    held = set(steps)
    if not held:
        return set()
    settled = held & set(agreed)
    floor = max(settled) if settled else min(held)
    return {s for s in held if s >= floor} | (held & set(pinned))


class JobAgreement:
    """The job's counters of kept steps, in ``store`` (a torch.distributed Store under this
    open's prefix). Called from the keeper's agreement thread, and from a save that needs the
    memory of a kept snapshot (``Keeper._reclaim``)."""

    def __init__(self, store: Any, *, rank: int, world_size: int) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.agreed: set[int] = set()  # steps known to be kept by every rank

    def post(self, step: int) -> None:
        """This rank keeps ``step`` (its record is in place)."""
        if self.store.add(f"kept/{step}", 1) >= self.world_size:
            self.agreed.add(step)

    def refresh(self, steps: Iterable[int]) -> set[int]:
        """The agreed steps among ``steps``, read from the counters of those not known yet."""
        for step in steps:
            if step not in self.agreed and self.store.add(f"kept/{step}", 0) >= self.world_size:
                self.agreed.add(step)
        newest = max(self.agreed, default=None)
        if newest is not None:
            old = {s for s in self.agreed if s < newest - _KEEP_COUNTERS}
            if self.rank == 0:
                for step in old:  # every rank posted them: nobody reads them again
                    self.store.delete_key(f"kept/{step}")
            self.agreed -= old
        return self.agreed & set(steps)
