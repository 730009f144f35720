"""``PerRank``: a value that differs on each rank of a multi-rank job (RNG state, data position).

Everything else in a multi-rank save is either a DTensor (each rank stores its shard) or
replicated (the same on every rank, stored once). A ``PerRank`` value is stored by every
rank, as its own, and ``restore`` gives each rank back the value of its rank index; at
another world size that is impossible, and ``restore`` says so, naming the key. A
single-process ``mpckpt.load`` of a multi-rank checkpoint gives a list with every rank's
value, in rank order (a one-process checkpoint: a list of one).
"""

from __future__ import annotations

from typing import Any


class PerRank:
    """Wraps a value (or an object with ``state_dict``, such as ``mpckpt.RNGState()``) that is
    saved and restored per rank: ``state = {"rng": mpckpt.PerRank(mpckpt.RNGState())}``."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        if isinstance(value, PerRank):
            raise TypeError("PerRank(PerRank(...)) holds a value per rank twice; wrap the value once")
        self.value = value

    def __repr__(self) -> str:
        return f"PerRank({self.value!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PerRank) and _same(self.value, other.value)

    __hash__ = None  # type: ignore[assignment]


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except RuntimeError:  # tensors of several elements
        return a is b


NOT_RESTORED = object()  # what a PerRank value restore cannot give back becomes (strict=False: left as it is)
