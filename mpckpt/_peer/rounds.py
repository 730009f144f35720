"""Which step every rank copies to other nodes next, and which steps are copied for every rank.

A node lost needs one step whose every rank's part is held by a survivor: the lost ranks' parts
as copies on other nodes, the others' in their own memory. If each rank copied whatever it kept
last, with a save every step and a copy longer than a step the ranks would rarely copy the same
step, and each new snapshot would overtake the copy in flight: in a chaos run only 2 of 28
copies got through. So the job copies in rounds, through its store (keys under the link's
prefix, never a collective):

- rank 0 opens round k with the newest step it keeps (``rep/round/<k>``), once every rank is
  done with round k-1 (``rep/done/<k-1>`` at the world size) and it keeps a newer step;
- every rank sends its snapshot of that step to its targets, at the pace the replicator sets,
  never overtaken by newer snapshots, then counts itself done, and when every copy got there
  counts the step copied (``rep/ok/<step>``);
- a step whose count is at the world size is copied everywhere.

What is held for it (``_keep.agreement.to_hold``, the rule of the kept snapshots): a rank holds
its own snapshot of the round's step until its copies are sent, then until every rank is done
with the round (the others' copies of that step may still be landing: were it let go, the
receivers' newest copy of a step copied everywhere would have no partner), and of the newest
step copied everywhere (``copied``); a receiver holds a source's newest copy and its copy of the
newest step copied everywhere. So a node lost at any moment finds a step whose every part is
held by a survivor: the newest copied everywhere, behind the newest save by at most the time
two copies take. A rank that does not hold the round's step (it skipped that save, or the
budget took it) is done with the round without a copy: the round is not copied everywhere, the
previous one stays held, nothing is lost.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Iterable
from typing import Any

_FORGET = 8  # rank 0 removes the keys of rounds this far behind


class Rounds:
    """The job's rounds of copies, as one rank sees them (``store``: the link's, cloned per thread)."""

    def __init__(self, store: Any, *, rank: int, world_size: int) -> None:
        self._store, self.rank, self.world_size = store, rank, world_size
        self._local = threading.local()
        self._lock = threading.Lock()
        self.copied: set[int] = set()  # steps known to be copied everywhere
        self.known: dict[int, int] = {}  # round -> its step, as learnt

    @property
    def store(self) -> Any:
        store = getattr(self._local, "store", None)
        if store is None:
            store = self._local.store = self._store.clone()
        return store

    @property
    def leads(self) -> bool:
        return self.rank == 0

    def open(self, k: int, step: int) -> None:
        """(Rank 0.) Round ``k`` copies ``step``."""
        self.store.set(f"rep/round/{k}", str(step))
        self.known[k] = step
        if k >= _FORGET:
            for what in ("round", "done", "end"):
                self.store.delete_key(f"rep/{what}/{k - _FORGET}")

    def step_of(self, k: int) -> int | None:
        """The step of round ``k`` once rank 0 opened it (a look, no wait)."""
        if k not in self.known:
            if not self.store.check([f"rep/round/{k}"]):
                return None
            self.known[k] = int(bytes(self.store.get(f"rep/round/{k}")).decode())
            for old in [r for r in list(self.known) if r < k - 2]:
                self.known.pop(old, None)  # (the sender and the keeper's agreement thread both look)
        return self.known[k]

    def finish(self, k: int, step: int, *, copied: bool) -> None:
        """This rank is done with round ``k`` (of ``step``): every copy got there, or not. The last
        rank done says the round ended (``rep/end/<k>``, what rank 0 waits for)."""
        if copied and self.store.add(f"rep/ok/{step}", 1) >= self.world_size:
            with self._lock:
                self.copied.add(step)
        if self.store.add(f"rep/done/{k}", 1) >= self.world_size:
            self.store.set(f"rep/end/{k}", "1")

    def ended(self, k: int, timeout_s: float) -> bool:
        """Whether every rank is done with round ``k``, waiting at most ``timeout_s``."""
        return k < 0 or _waited(self.store, f"rep/end/{k}", timeout_s)

    def opened(self, k: int, timeout_s: float) -> int | None:
        """The step of round ``k``, waiting at most ``timeout_s`` for rank 0 to open it."""
        if k not in self.known and not _waited(self.store, f"rep/round/{k}", timeout_s):
            return None
        return self.step_of(k)

    def refresh(self, steps: Iterable[int]) -> set[int]:
        """Of ``steps``, those copied everywhere (the counters of those not known yet read now)."""
        steps = set(steps)
        for step in steps - self.copied:
            if self.store.check([f"rep/ok/{step}"]) and self.store.add(f"rep/ok/{step}", 0) >= self.world_size:
                with self._lock:
                    self.copied.add(step)
        with self._lock:
            return self.copied & steps

    def pinned(self, k: int, held: Iterable[int], sending: int | None) -> set[int]:
        """The steps of this rank's own snapshots its copies need held (``held``: those it keeps),
        read now: the round being sent (``sending``) or opened next (``k``), the newest copied
        everywhere, and the step of the round this rank is done with (``k - 1``) while the other
        ranks may still be sending theirs: once they are, it may become the newest copied
        everywhere, and the receivers then let the older copies go."""
        held = set(held)
        copied = self.refresh(held)
        newest = max(copied, default=-1)
        out = {newest} if copied else set()
        if sending is not None:
            out.add(sending)
        upcoming = self.step_of(k)
        if upcoming is not None:
            out.add(upcoming)
        previous = self.step_of(k - 1) if k > 0 else None
        if previous is not None and previous > newest and not self._ended_uncopied(k - 1, previous):
            out.add(previous)
        return out & held

    def _ended_uncopied(self, k: int, step: int) -> bool:
        """Whether round ``k`` (of ``step``) ended without its step copied everywhere (a rank
        done counts its copies before the round's end is set: the count is final then)."""
        return self.store.check([f"rep/end/{k}"]) and self.store.add(f"rep/ok/{step}", 0) < self.world_size


def _waited(store: Any, key: str, timeout_s: float) -> bool:
    """Whether ``key`` is set, waiting at most ``timeout_s``; a store that fails at once (gone)
    still takes that long, so that a caller's loop never spins."""
    started = time.monotonic()
    try:
        store.wait([key], datetime.timedelta(seconds=timeout_s))
        return True
    except Exception:  # (the wait ran out, or the store is gone)
        time.sleep(max(0.0, timeout_s - (time.monotonic() - started)))
        return False
