"""What the tensor table of a walk's rows depends on, and checking it again at the next save.

A repeated save takes the last flatten's table over only when every row's address, storage
offset, dtype, shape and strides (and device) are what they were (``recall.FlattenMemo``).
Reading them costs about 1.5 us a tensor from Python, most of it ``t.shape`` (a new
``torch.Size`` each time): 150 ms for 100,000 tensors, more than copying their bytes. Where
torch's own C++ tensor check is at hand (``TensorGuards``, what compiled graphs check their
inputs with: dtype, device, dispatch keys, ``requires_grad``, sizes, strides; one C loop over
all rows), it checks everything but the address and the storage offset, which are read as two
columns. It is asked to say no to every kind of change first (``_guard_checks_layout``); a torch
whose check does not, or that has none, gets the columns for every figure. A check that says
no for a change the table does not depend on (``requires_grad``) only costs one fresh flatten.
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import torch

PLAIN_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})
_ADDRESS = (torch.Tensor.data_ptr, torch.Tensor.storage_offset)
_LAYOUT = (operator.attrgetter("dtype"), operator.attrgetter("shape"), torch.Tensor.stride)
_ERRORS = (RuntimeError, NotImplementedError, TypeError)  # sparse, nested, meta...: no address or strides


class Signatures:
    """The figures of a walk's rows (all plain tensors), checked again by ``match``.

    Storage groups, shared byte ranges, views and frozen leaves are functions of these figures
    alone (a storage's base address is ``data_ptr - storage_offset * itemsize``), so equal
    signatures give an equal table whichever storage objects the addresses belong to now. Each
    figure is one column read over all rows in one ``map`` (a C loop); the layout ones are, where
    torch allows, checked in C++ by a guard, made at the first save that matched the columns.
    """

    __slots__ = ("count", "address", "layout", "guard", "guards_made")

    def __init__(self, count: int, address: list[list[Any]], layout: list[list[Any]]) -> None:
        self.count = count
        self.address = address
        self.layout = layout
        self.guard: Any = None  # a TensorGuards over the rows' layout, made at a match of the columns
        self.guards_made = 0

    @staticmethod
    def of(rows: list[Any]) -> Signatures | None:
        """None if a row is no plain strided tensor (the full checks then say what is wrong with it)."""
        if not set(map(type, rows)) <= PLAIN_TENSORS:
            return None
        try:
            return Signatures(len(rows), [list(map(figure, rows)) for figure in _ADDRESS],
                              [list(map(figure, rows)) for figure in _layout_figures()])
        except _ERRORS:
            return None

    def match(self, rows: list[Any]) -> bool:
        """Whether ``rows`` have the figures these were made of. The guard's yes is final; its no
        (it refuses more than the table depends on: a module's parameters, read from the module
        tree, want gradients where the ``state_dict()`` ones of the walk before did not) is asked
        of the columns, and a guard is made of ``rows`` when they agree (at most twice, so a state
        whose guard keeps refusing is checked by the columns alone)."""
        if len(rows) != self.count or not set(map(type, rows)) <= PLAIN_TENSORS:
            return False
        try:
            if not all(list(map(figure, rows)) == column for figure, column in zip(_ADDRESS, self.address, strict=True)):
                return False
            if self.guard is not None and self.guard.check(*rows):
                return True
            if not all(list(map(figure, rows)) == column
                       for figure, column in zip(_layout_figures(), self.layout, strict=True)):
                return False
        except _ERRORS:
            return False
        if self.guards_made < 2 and rows:
            self.guards_made += 1
            self.guard = _guard(rows, self.layout[1], self.layout[2])
        return True


def _layout_figures() -> tuple[Any, ...]:
    return (*_LAYOUT, operator.attrgetter("device")) if torch.cuda.is_available() else _LAYOUT


def _guard(rows: list[Any], shapes: list[Any], strides: list[Any]) -> Any:
    """A C++ check of ``rows``' layout as it is now, or None (no such check in this torch, or one
    that does not see every change ``Signatures`` must)."""
    if not _guard_checks_layout():
        return None
    try:
        return _make_guard(rows, shapes, strides)
    except Exception:  # noqa: BLE001  (a private torch API: any failure means the columns are used)
        return None


def _make_guard(rows: list[Any], shapes: list[Any], strides: list[Any]) -> Any:
    from torch._C._dynamo.guards import TensorGuards

    # per tensor, its sizes and strides (each an int: checked as it is; None: not checked)
    sizes: Any = [list(shape) for shape in shapes]
    steps: Any = [list(stride) for stride in strides]
    return TensorGuards(*rows, dynamic_dims_sizes=sizes, dynamic_dims_strides=steps)


@functools.cache
def _guard_checks_layout() -> bool:
    """Whether this torch's tensor guard accepts an equal tensor and refuses every change of dtype,
    shape, strides and device that the table depends on (checked once, on small tensors)."""
    try:
        base = torch.zeros(4, 4)
        guard = _make_guard([base], [base.shape], [base.stride()])
        changed = [torch.zeros(16), torch.zeros(2, 8), torch.zeros(4, 4).t(), torch.zeros(8, 4)[::2],
                   torch.zeros(4, 4, dtype=torch.float64), torch.zeros(4, 4, dtype=torch.int32), torch.zeros(4, 4, 1),
                   torch.zeros(4, 4, device="meta")]
        grown = torch.zeros(4, 4)
        grown.resize_(5, 4)
        changed.append(grown)
        return bool(guard.check(torch.ones(4, 4))) and not any(bool(guard.check(t)) for t in changed)
    except Exception:  # noqa: BLE001  (no such API in this torch, or another signature)
        return False
