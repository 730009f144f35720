"""Which of its own snapshots a rank's copies need held (``_peer.rounds.Rounds.pinned``), over a
real in-memory torch.distributed store.

The invariant a node loss relies on: the newest step a receiver holds as "copied everywhere" is
also held by every sender in its own memory. A rank done with a round before the others must
not let that round's step go: the others' copies of it may still be landing, and once they are
the step is the newest copied everywhere and the receivers let the older copies go.
"""

from __future__ import annotations

import torch.distributed as dist

from mpckpt._keep.agreement import to_hold
from mpckpt._peer.rounds import Rounds


def _job(world: int = 2) -> list[Rounds]:
    store = dist.HashStore()
    return [Rounds(store, rank=r, world_size=world) for r in range(world)]


def _rank_0_done_first() -> tuple[Rounds, Rounds]:
    """Round 0 (step 14) copied everywhere; in round 1 (step 16) rank 0's copy landed, rank 1's is
    still on its way."""
    fast, slow = _job()
    fast.open(0, 14)
    for r in (fast, slow):
        r.finish(0, 14, copied=True)
    fast.open(1, 16)
    fast.finish(1, 16, copied=True)
    return fast, slow


def test_a_rank_done_first_holds_the_round_step_until_the_others_are_done():
    fast, slow = _rank_0_done_first()
    held = [14, 16, 17, 18]  # rank 0's own kept snapshots (17, 18 agreed meanwhile)
    assert fast.pinned(2, held, None) == {14, 16}
    slow.finish(1, 16, copied=True)  # rank 1's copy of 16 landed: 16 is copied everywhere
    assert fast.pinned(2, held, None) == {16}
    copies_on_node_0 = to_hold([14, 16, 18], slow.refresh([14, 16, 18]))
    assert max(copies_on_node_0 & {14, 16}) == 16 and 16 in fast.pinned(2, held, None)


def test_a_round_that_ended_uncopied_is_not_held_for():
    fast, slow = _rank_0_done_first()
    slow.finish(1, 16, copied=False)  # rank 1's copy failed: 16 will never be copied everywhere
    assert fast.pinned(2, [14, 16, 17], None) == {14}


def test_the_step_being_sent_and_the_next_round_are_held():
    lead, other = _job()
    lead.open(0, 5)
    assert other.pinned(0, [4, 5, 6], None) == {5}      # opened, not yet sending
    assert other.pinned(0, [4, 5, 6], 5) == {5}
    for r in (lead, other):
        r.finish(0, 5, copied=True)
    assert lead.pinned(1, [5, 6, 7], None) == {5}       # copied everywhere
    lead.open(1, 7)
    assert other.pinned(1, [5, 6, 7], None) == {5, 7}
