"""Which kept snapshots a rank of a job holds (``_keep.agreement.to_hold``), and the job's counters.

The rule: the newest; the newest step known to be kept by every rank and all newer ones (none
known: everything held); whatever another part pins. Checked against every order in which two
and three ranks can keep and learn of steps: some step stays held by every rank throughout.
"""

from __future__ import annotations

import itertools

from mpckpt._keep.agreement import JobAgreement, to_hold


def test_the_newest_and_the_newest_agreed_step_are_held():
    assert to_hold([], []) == set()
    assert to_hold([7], []) == {7}
    assert to_hold([6, 7], [6]) == {6, 7}          # 7 not agreed yet: 6 stays
    assert to_hold([6, 7], [6, 7]) == {7}          # 7 agreed: 6 goes
    assert to_hold([5, 6, 7], [5]) == {5, 6, 7}    # 6 may be agreed next: kept beside
    assert to_hold([5, 6, 7], [6]) == {6, 7}
    assert to_hold([6, 7], []) == {6, 7}           # nothing known agreed: all held
    assert to_hold([4, 6, 7], [7], pinned=[4]) == {4, 7}


class _Store:
    """The counter calls of a torch.distributed Store, in memory (unit test of the bookkeeping only)."""

    def __init__(self) -> None:
        self.values: dict[str, int] = {}

    def add(self, key: str, n: int) -> int:
        self.values[key] = self.values.get(key, 0) + n
        return self.values[key]

    def delete_key(self, key: str) -> bool:
        return self.values.pop(key, None) is not None


def test_a_step_is_agreed_once_every_rank_posted_it():
    store = _Store()
    a, b = (JobAgreement(store, rank=r, world_size=2) for r in range(2))
    a.post(3)
    assert a.refresh([3]) == set()
    b.post(3)
    assert 3 in b.agreed and a.refresh([3]) == {3}
    for step in range(4, 20):
        a.post(step)
        b.post(step)
        a.refresh([step])
    assert "kept/3" not in store.values, "rank 0 removes the counters of old steps"
    assert "kept/19" in store.values


def _simulate(world: int, order: tuple[int, ...], steps: int = 4) -> None:
    """Ranks keep steps 0..steps-1 in the interleaving ``order`` (each entry: a rank's next action,
    keep its next step then learn the counters); after every action some step is held by all."""
    store = _Store()
    agreements = [JobAgreement(store, rank=r, world_size=world) for r in range(world)]
    held: list[set[int]] = [set() for _ in range(world)]
    nxt = [0] * world
    for r in order:
        if nxt[r] >= steps:
            continue
        step = nxt[r]
        nxt[r] += 1
        held[r].add(step)
        agreements[r].post(step)
        agreements[r].refresh(held[r])
        held[r] = to_hold(held[r], agreements[r].agreed)
        if all(nxt):  # once every rank kept a step, one is held by every rank
            assert set.intersection(*held), (order, held)


def test_some_step_is_held_by_every_rank_whatever_the_order():
    for world in (2, 3):
        # ranks at most one step apart (a collective in every step): every interleaving of 4 steps
        for order in set(itertools.permutations([r for r in range(world) for _ in range(3)])):
            _simulate(world, order, steps=3)
    _simulate(2, (0, 0, 0, 0, 1, 1, 1, 1))  # one rank far ahead: everything held until the other catches up
