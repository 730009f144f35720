"""Overlapped snapshots: the copy runs in a background thread while training goes on.

``save(..., overlap=True)`` copies right away only what the next forward/backward may change
in place (buffers such as batch-norm statistics, loose tensors, plain values) and hands the
copy of parameters and optimizer state to a background thread; tensor copies release the
GIL, so the next forward/backward runs meanwhile. Parameters and optimizer state change only
inside ``optimizer.step()``, so a global optimizer step pre-hook waits for the copy first
(``barrier``). Any other in-place update (an EMA, a manual weight edit) must call
``Checkpointer.snapshot_barrier()`` first. The time the hook waits is added to that save's
``barrier_ms``: the training loop did wait for it.

On a GPU the copies are enqueued on mpckpt's own stream at ``save`` (``device``); the hook then
makes the step's stream wait for their event on the GPU, and the host thread waits for nothing
(``barrier_ms`` stays 0: the GPU's wait is the copy's remaining time, not the loop's).

INVARIANT: at most one background copy is in flight; a new save waits for the previous one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from mpckpt._codec.snapshot import FlatState
from mpckpt._futures import SaveStats
from mpckpt._stage import device
from mpckpt._threads import executor
from mpckpt.errors import WaitTimeoutError

_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def step_guarded_leaves(state: Any, flat: FlatState) -> set[int]:
    """Leaves that only ``optimizer.step()`` modifies: module parameters and optimizer state."""
    ptrs: set[int] = set()

    def visit(value: Any) -> None:
        if isinstance(value, torch.nn.Module):
            ptrs.update(_local(p).data_ptr() for p in value.parameters())
        elif isinstance(value, torch.optim.Optimizer):
            for per_param in value.state.values():
                ptrs.update(_local(t).data_ptr() for t in per_param.values()
                            if isinstance(t, torch.Tensor) and t.numel())
        elif isinstance(value, (dict, list, tuple)):
            for v in value.values() if isinstance(value, dict) else value:
                if type(v) not in _PLAIN_TENSORS:  # (a dict of 100,000 tensors holds no module)
                    visit(v)

    visit(state)
    if not ptrs:  # no module or optimizer in the state: every leaf is copied before the save returns
        return set()
    return {i for i, (leaf, source) in enumerate(zip(flat.leaves, flat.sources, strict=True))
            if not leaf.raw and leaf.nbytes and source.data_ptr() in ptrs}


class GuardedLeaves:
    """``step_guarded_leaves`` of the last state, and the other leaves, as sets kept while its
    tensors stay: a repeated save of them (the flatten memo's hit hands back the very same
    ``FlatState.key`` object, made when they were first seen at these addresses) asks no module
    or optimizer again, and the device copies keep their plans restricted to the same two sets."""

    def __init__(self) -> None:
        self._key: Any = None
        self._sets: tuple[frozenset[int], frozenset[int]] = (frozenset(), frozenset())

    def of(self, state: Any, flat: FlatState) -> tuple[frozenset[int], frozenset[int]]:
        """(the leaves only an optimizer step changes, every other leaf) of ``flat``."""
        if self._key is not flat.key or not flat.key:
            guarded = frozenset(step_guarded_leaves(state, flat))
            self._key, self._sets = flat.key, (guarded, frozenset(range(len(flat.leaves))) - guarded)
        return self._sets


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what a multi-rank save copies), or the tensor itself."""
    return getattr(t, "_local_tensor", t)


class BackgroundCopier:
    """One background copy at a time, and the barrier that waits for it."""

    def __init__(self, *, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._executor = executor(1, "mpckpt-copy")
        self._idle = threading.Event()
        self._idle.set()
        self._stats: SaveStats | None = None
        self._device_events: device.Events = []  # the copy in flight runs on a GPU (``device``)
        self._copied = False  # the copy is done: the background only keeps and submits it
        self._hook = register_optimizer_step_pre_hook(self._before_step)

    def _before_step(self, *_: Any) -> None:
        events = self._device_events
        if events:  # the step's kernels wait for the copies on the GPU; every optimizer's step does
            device.stream_wait(events)
            return
        if not self._copied:
            self.barrier()

    def barrier(self) -> float:
        """Wait for the copy in flight (if any); return the milliseconds waited."""
        if self._idle.is_set():
            return 0.0
        started = time.perf_counter()
        if not self._idle.wait(self.timeout_s):
            raise WaitTimeoutError(f"the background snapshot copy did not finish within {self.timeout_s:.0f}s")
        waited = (time.perf_counter() - started) * 1e3
        if self._stats is not None:
            self._stats.barrier_ms += waited
        return waited

    def run(self, stats: SaveStats, copy: Callable[[], None], *, device_events: device.Events | None = None,
            copied: bool = False) -> None:
        """Start ``copy`` in the background (after any earlier copy has finished); ``device_events``:
        the snapshot's copies already enqueued on a GPU, which an optimizer step waits for there;
        ``copied``: every copy is already done (``copy`` keeps and submits), a step waits for nothing."""
        self.barrier()
        self._idle.clear()
        self._stats = stats
        self._device_events = list(device_events or [])
        self._copied = copied

        def wrapped() -> None:
            try:
                copy()
            finally:
                self._idle.set()

        self._executor.submit(wrapped)

    def close(self) -> None:
        try:
            self.barrier()
        finally:
            self._hook.remove()
            self._executor.shutdown(wait=True)
