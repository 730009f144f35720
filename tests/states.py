"""The small states tests save and compare, made in one place from a value or a seed.

``filled_state``: one tensor ``w`` filled with a value (a restore shows at a glance which step it
holds), and ``step`` when asked. ``random_state``: tensors drawn in the order named from a
generator seeded with ``seed`` (never the global one), so a seed gives the same bytes in every
process and every call: a trainer process and the test that checks what it saved agree. Each
test names the shapes, dtypes and values it needs; the models tests train are ``make_model`` in
``tests/conftest.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def filled_state(value: float, shape: tuple[int, ...] = (64,), *, step: int | None = None) -> dict[str, Any]:
    """``{"w": torch.full(shape, value)}`` (an int ``value`` gives an int64 tensor, as torch does),
    with ``"step": step`` after it unless ``step`` is None."""
    state: dict[str, Any] = {"w": torch.full(shape, value)}
    if step is not None:
        state["step"] = step
    return state


def random_state(seed: int, shapes: Mapping[str, tuple[int, ...]], *, dtypes: Mapping[str, torch.dtype] | None = None,
                 step: int | None = None) -> dict[str, Any]:
    """One tensor per name of ``shapes``, in that order, from one generator seeded with ``seed``:
    normal float32 values cast to the name's dtype in ``dtypes`` (float32 if none), or for an
    integer dtype integers in [0, 2**30); with ``"step": step`` last unless ``step`` is None."""
    g = torch.Generator().manual_seed(seed)
    state: dict[str, Any] = {}
    for name, shape in shapes.items():
        dtype = (dtypes or {}).get(name, torch.float32)
        if dtype.is_floating_point:
            state[name] = torch.randn(shape, generator=g).to(dtype)
        else:
            state[name] = torch.randint(0, 1 << 30, shape, generator=g, dtype=dtype)
    if step is not None:
        state["step"] = step
    return state
