"""The flatten memo gives exactly what a fresh flatten gives, whatever changed between saves."""

from __future__ import annotations

import torch

from mpckpt._stage.snapshot import FlatState, FlattenMemo, flatten


def same(a: FlatState, b: FlatState) -> None:
    assert a.tree == b.tree
    assert a.table == b.table
    assert a.leaves == b.leaves
    assert a.frozen == b.frozen and a.nbytes == b.nbytes and a.key == b.key
    assert len(a.sources) == len(b.sources)
    for x, y in zip(a.sources, b.sources, strict=True):
        assert (x.data_ptr(), x.dtype, x.shape, x.stride()) == (y.data_ptr(), y.dtype, y.shape, y.stride())


def check(memo: FlattenMemo, state: object) -> FlatState:
    flat = flatten(state, memo=memo)
    same(flat, flatten(state))
    return flat


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def test_a_repeated_save_reuses_the_table_and_binds_the_new_tensor_objects() -> None:
    memo, m = FlattenMemo(), model()
    first = check(memo, {"model": m})
    second = check(memo, {"model": m})
    assert second.leaves is first.leaves  # reused, not rebuilt
    # state_dict() detaches: new tensor objects over the same memory each time
    assert all(a is not b for a, b in zip(first.sources, second.sources, strict=True))
    assert second.sources[0].data_ptr() == m[0].weight.data_ptr()


def test_every_change_to_the_tensors_is_seen() -> None:
    memo = FlattenMemo()
    base = torch.arange(24, dtype=torch.float32)
    state = {"a": base[:12].view(3, 4), "b": base[6:18], "c": torch.ones(5), "z": torch.zeros(0)}
    check(memo, state)
    state["c"] = torch.ones(5)                          # a new storage
    check(memo, state)
    state["a"] = base[:12].view(4, 3)                   # same memory, another shape
    check(memo, state)
    state["a"] = base[:12].view(3, 4).t()               # same memory, other strides
    check(memo, state)
    state["b"] = base[:12]                              # no longer overlapping the same bytes
    check(memo, state)
    state["b"] = state["a"]                             # one object twice: one row
    check(memo, state)
    state["c"] = torch.ones(5, dtype=torch.complex64)   # stored through a real view
    check(memo, state)
    state["c"] = torch.ones(5, dtype=torch.float64)
    check(memo, state)
    state["renamed"] = state.pop("c")                   # same tensors, other key paths
    flat = check(memo, state)
    assert any(leaf.name == "renamed" for leaf in flat.leaves)


def test_a_shared_byte_range_is_bound_to_the_new_storage() -> None:
    memo = FlattenMemo()
    storage = torch.arange(10, dtype=torch.float32)
    check(memo, {"x": storage[2:6], "y": storage[4:9]})
    flat = check(memo, {"x": storage[2:6], "y": storage[4:9]})
    (raw,) = [s for s, leaf in zip(flat.sources, flat.leaves, strict=True) if leaf.raw]
    assert raw.data_ptr() == storage[2:].data_ptr() and raw.numel() == 7 * 4


def test_freezing_a_parameter_changes_the_frozen_leaves() -> None:
    memo, m = FlattenMemo(), model()
    assert not check(memo, {"model": m}).frozen
    m[0].weight.requires_grad_(False)
    assert check(memo, {"model": m}).frozen


def test_a_bad_tensor_after_good_saves_is_still_refused() -> None:
    import pytest

    from mpckpt.errors import StateError

    memo = FlattenMemo()
    check(memo, {"x": torch.ones(3)})
    with pytest.raises(StateError, match="'x'.*sparse"):
        flatten({"x": torch.ones(3).to_sparse()}, memo=memo)
    with pytest.raises(StateError, match="'x'.*meta"):
        flatten({"x": torch.ones(3, device="meta")}, memo=memo)
