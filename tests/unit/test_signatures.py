"""The figures a repeated save's table depends on: every change is seen, on the C++ guard too."""

from __future__ import annotations

import torch

from mpckpt._codec.signatures import Signatures, _guard_checks_layout


class Marked(torch.Tensor):
    pass


def matched_twice(rows: list[torch.Tensor]) -> Signatures:
    sig = Signatures.of(rows)
    assert sig is not None and sig.match(rows)  # the columns agree: a guard is made of the rows
    assert sig.match(rows)
    return sig


def test_this_torch_has_a_guard_that_sees_every_change() -> None:
    # the fast path is in use with the torch this project pins (a torch without one uses the columns)
    assert _guard_checks_layout()
    rows = [torch.zeros(4, 4), torch.ones(3)]
    assert matched_twice(rows).guard is not None


def test_every_change_of_a_row_is_refused() -> None:
    def changed(change) -> bool:
        rows = [torch.zeros(4, 4), torch.arange(12.0)]
        sig = matched_twice(rows)
        assert sig.guard is not None
        change(rows)
        return not sig.match(rows)

    def resize(rows): rows[1].resize_(6)                                    # same object, same address
    def restride(rows): rows[0].set_(rows[0].untyped_storage(), 0, (4, 4), (1, 4))
    def reshape(rows): rows[1].set_(rows[1].untyped_storage(), 0, (3, 4), (4, 1))
    def retype(rows): rows[0].data = torch.zeros(4, 4, dtype=torch.float64)
    def offset(rows): rows[1].set_(rows[1].untyped_storage(), 2, (10,), (1,))
    def replaced(rows): rows[0] = torch.zeros(4, 4)                         # another storage
    def fewer(rows): rows.pop()
    def subclass(rows): rows[0] = rows[0].as_subclass(Marked)                # same memory, another type

    for change in (resize, restride, reshape, retype, offset, replaced, fewer, subclass):
        assert changed(change), change.__name__


def test_a_change_the_table_does_not_depend_on_is_accepted_and_the_guard_made_again() -> None:
    rows = [torch.zeros(4, 4), torch.ones(3)]
    sig = matched_twice(rows)
    rows[1].requires_grad_(True)  # the guard refuses it; the columns say the table is the same
    assert sig.match(rows) and sig.guards_made == 2
    assert sig.match(rows) and sig.guards_made == 2  # the new guard accepts it
    rows[1].requires_grad_(False)
    assert sig.match(rows) and sig.guards_made == 2  # no third guard: the columns decide from now on
    rows[0].resize_(2)
    assert not sig.match(rows)


def test_the_columns_alone_see_every_change_without_a_guard() -> None:
    rows = [torch.zeros(4, 4), torch.arange(12.0)]
    sig = Signatures.of(rows)
    assert sig is not None and sig.guard is None
    sig.guards_made = 2  # as on a torch without a usable guard
    assert sig.match(rows) and sig.guard is None
    rows[1].set_(rows[1].untyped_storage(), 0, (3, 4), (4, 1))
    assert not sig.match(rows)
