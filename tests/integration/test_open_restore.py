"""What a restarted trainer's open and restore leave for later, off the path to a usable model.

``restore`` returns before the shared memory for the next save exists: it is made in a
background thread (two slabs, one at a time). A save that comes first takes what is made by
then, waits for the slab being made rather than making one more, and the memory budget holds.
``prepare`` called by the user still makes both slabs before it returns. (The uploaders
starting in the background, and a root they cannot write to failing at the first save:
``test_first_hour.py`` and ``test_pool.py``.)

The slab makers are held at a gate (``Arena._make`` on the warming thread), so what the tests
see does not depend on timing; every wait is bounded and no duration is asserted.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import mpckpt
from mpckpt import _testing
from mpckpt._stage.arena import Arena
from tests.conftest import assert_same
from tests.states import random_state
from tests.waiting import wait_until

BOUND_S = 60.0
BUDGET = 64 << 20


def _state(seed: int) -> dict[str, Any]:
    return random_state(seed, {"w": (1 << 20,), "b": (1000,)}, step=seed)  # about 4 MiB


@contextlib.contextmanager
def _held_warming(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Inside, every slab made in the background waits until the event is set (at the latest on leaving)."""
    opened = threading.Event()
    make = Arena._make

    def gated(self: Arena, size: int, *, touch: bool) -> Any:
        if threading.current_thread().name == "mpckpt-spare-slab":
            assert opened.wait(BOUND_S), "the test never opened the gate"
        return make(self, size, touch=touch)

    monkeypatch.setattr(Arena, "_make", gated)
    try:
        yield opened
    finally:
        opened.set()


def _saved(root: Any) -> dict[str, Any]:
    state = _state(1)
    with mpckpt.Checkpointer(root, workers=1) as ckpt:
        ckpt.save(1, state, mode="sync")
    return state


def test_restore_returns_before_the_shared_memory_for_the_next_save_exists(tmp_path, monkeypatch):
    saved = _saved(tmp_path)
    live = _state(2)
    with mpckpt.Checkpointer(tmp_path, workers=1, memory_budget=BUDGET) as ckpt, \
            _held_warming(monkeypatch) as gate:
        assert ckpt.restore(live) == 1
        assert_same(saved, live)
        assert _testing.slabs(ckpt) == []  # none exists yet: the first is being made, behind the gate
        slab_bytes = ckpt._rt.saver.slab_bytes_for(live)
        assert 0 < ckpt._rt.arena.allocated_bytes < 2 * slab_bytes  # the one being made counts, one only
        gate.set()
        wait_until(lambda: len(_testing.slabs(ckpt)) == 2, BOUND_S,
                   "the first save's slab and the next one's")
        warmed = {slab.name for slab in _testing.slabs(ckpt)}
        live["step"] = 2
        ckpt.save(2, live).result(BOUND_S)
        assert {slab.name for slab in _testing.slabs(ckpt)} == warmed  # the save took one, made none
        assert ckpt.stats.peak_shm_bytes <= BUDGET
    assert_same(live, mpckpt.load(tmp_path))


def test_a_save_before_the_warming_is_done_waits_for_the_slab_being_made(tmp_path, monkeypatch):
    _saved(tmp_path)
    live = _state(2)
    with mpckpt.Checkpointer(tmp_path, workers=1, memory_budget=BUDGET) as ckpt, \
            _held_warming(monkeypatch) as gate:
        ckpt.restore(live)
        opener = threading.Timer(0.2, gate.set)  # lets the save below start first (either order is correct)
        opener.start()
        live["step"] = 2
        ckpt.save(2, live).result(BOUND_S)
        wait_until(lambda: len(_testing.slabs(ckpt)) == 2 and ckpt._rt.arena.allocated_bytes == sum(
            slab.capacity for slab in _testing.slabs(ckpt)), BOUND_S, "the warming's two slabs")
        slabs = _testing.slabs(ckpt)
        assert len(slabs) == 2  # the warming's two: the early save made no third
        assert ckpt.stats.peak_shm_bytes <= sum(slab.capacity for slab in slabs) <= BUDGET
        opener.join()
    assert_same(live, mpckpt.load(tmp_path))


def test_prepare_makes_both_slabs_before_it_returns(tmp_path):
    saved = _saved(tmp_path)
    with mpckpt.Checkpointer(tmp_path, workers=1, memory_budget=BUDGET) as ckpt:
        need = ckpt.prepare(saved)
        slabs = _testing.slabs(ckpt)
        assert len(slabs) == 2 and all(slab.capacity >= need and not slab.in_use for slab in slabs)


def test_prepare_plans_the_first_saves_and_they_use_what_it_made(tmp_path):
    # the layout, both slabs' views of it and the memo's checks are made by prepare, not by saves 1 and 2
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)).to(torch.bfloat16)
    moments = {f"m{i}": torch.randn(i + 1, 3) for i in range(20)}
    state = {"model": model, "moments": moments, "mask": torch.ones(5, dtype=torch.bool),
             "z": torch.complex(torch.ones(2), torch.zeros(2)), "step": 1}
    with mpckpt.Checkpointer(tmp_path, workers=1, memory_budget=BUDGET) as ckpt:
        ckpt.prepare(state)
        slabs = _testing.slabs(ckpt)
        assert len(slabs) == 2 and all(len(slab.views) == 1 for slab in slabs)
        made = {slab.name: next(iter(slab.views.values())) for slab in slabs}
        for step in (1, 2, 3):
            state["step"] = step
            ckpt.save(step, state).result(BOUND_S)
        for slab in slabs:  # the saves copied through the views prepare made: none made again
            assert len(slab.views) == 1 and next(iter(slab.views.values())) is made[slab.name]
    got = mpckpt.load(str(tmp_path), 3)
    assert got["step"] == 3
    assert_same(got["moments"], moments)
    assert_same({k: got[k] for k in ("mask", "z")}, {k: state[k] for k in ("mask", "z")})
    assert_same(dict(got["model"]), dict(model.state_dict()))
