"""Test hooks: what the test suite may observe of a Checkpointer's internals, in one place.

Tests go through the public API wherever it says enough. Where a test must see inside (which
shared-memory slabs exist, whether an upload has started, whether uploads run in threads),
it asks here, so the internals can change without tests reaching into private attributes
all over the suite. Nothing in the package imports this module.
"""

from __future__ import annotations

from typing import Any


def slabs(ckpt: Any) -> list[Any]:
    """The shared-memory slabs the checkpointer's arena holds (``.name``, ``.in_use``, ``.pinned``)."""
    arena = ckpt._rt.arena
    return [] if arena is None else list(arena._slabs)


def upload_started(ckpt: Any, seq: int) -> bool:
    """Whether an uploader has taken a job of the save with sequence number ``seq``."""
    return bool(ckpt._rt.pool.started(seq))


def uploads_in_process(ckpt: Any) -> bool:
    """Whether uploads run in threads of this process (storage that exists only here)."""
    return bool(ckpt._rt.pool.in_process)
