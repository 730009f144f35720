"""The flatten memo gives exactly what a fresh flatten gives, whatever changed between saves."""

from __future__ import annotations

import torch

from mpckpt._codec.snapshot import FlatState, FlattenMemo, flatten


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


# -- what a repeated save takes over from the last walk (``_codec.recall``) -------------------------
def checked(memo: FlattenMemo, state: object) -> FlatState:
    """``check``, and the skeleton made of parts kept between saves is the one a fresh walk gives."""
    import json

    from mpckpt._stage.layout import LayoutCache
    from mpckpt._stage.skeleton_text import SkeletonText, leaves_doc

    flat = check(memo, state)
    layouts, skeleton = memo.__dict__.setdefault("test_text", (LayoutCache(budget_bytes=1 << 30, workers=2),
                                                               SkeletonText()))
    layout = layouts.layout_for(flat)
    fresh = flatten(state)
    doc = {"version": 1, "tree": fresh.tree, "table": fresh.table, "leaves": leaves_doc(fresh, layout)}
    assert skeleton(flat, layout) == json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
    return flat


def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3), torch.nn.Linear(3, 2, bias=False),
                            torch.nn.BatchNorm1d(2))
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    m(torch.randn(5, 4)).sum().backward()
    opt.step()
    return m, opt


def test_a_repeated_save_of_a_model_and_its_optimizer_takes_the_last_walk_over() -> None:
    memo, (m, opt) = FlattenMemo(), trained()
    checked(memo, {"model": m, "optim": opt, "step": 1})
    flat = checked(memo, {"model": m, "optim": opt, "step": 2})
    assert set(memo.recall._last) == {("m", "model"), ("d", "optim.state")}  # both taken over
    assert flat.sources[0].data_ptr() == m[0].weight.data_ptr()


def test_a_parameter_replaced_or_given_new_memory_is_seen() -> None:
    memo, (m, opt) = FlattenMemo(), trained()
    state = {"model": m, "optim": opt}
    checked(memo, state)
    m[0].weight = torch.nn.Parameter(torch.randn(3, 4))         # a new parameter object
    assert checked(memo, state).sources[0].data_ptr() == m[0].weight.data_ptr()
    m[0].weight.data = torch.randn(3, 4)                        # the same object, new memory
    assert checked(memo, state).sources[0].data_ptr() == m[0].weight.data_ptr()
    m.double()                                                   # the same objects, another dtype (.data=)
    flat = checked(memo, state)
    assert flat.leaves[0].dtype == torch.float64
    with torch.no_grad():
        m[0].weight.data = m[0].weight.data.t().contiguous().t()  # the same values, other strides
    checked(memo, state)


def test_modules_added_removed_or_emptied_are_seen() -> None:
    memo, (m, opt) = FlattenMemo(), trained()
    state = {"model": m, "optim": opt}
    checked(memo, state)
    m.add_module("extra", torch.nn.Linear(2, 2))
    assert any(leaf.name == "model.extra.weight" for leaf in checked(memo, state).leaves)
    m[0].bias = None                                             # a parameter set to None
    assert not any(leaf.name == "model.0.bias" for leaf in checked(memo, state).leaves)
    m[0].bias = torch.nn.Parameter(torch.zeros(3))               # and back
    checked(memo, state)
    m[1] = torch.nn.Identity()                                   # a submodule replaced (other class)
    checked(memo, state)
    m.extra = None                                               # a child set to None
    checked(memo, state)
    m[2].register_buffer("seen", torch.zeros(2))                # a persistent buffer
    checked(memo, state)
    m[2].register_buffer("scratch", torch.zeros(2), persistent=False)  # not in the state dict
    assert not any("scratch" in leaf.name for leaf in checked(memo, state).leaves)
    m[2].seen = None                                             # a buffer set to None
    checked(memo, state)
    m[0], m[2] = m[2], m[0]                                      # the same modules, other places
    checked(memo, state)
    m[0]._parameters = {"renamed": m[0].weight}                  # a parameter renamed, in its place
    checked(memo, state)
    m._modules = {("first" if k == "0" else k): v for k, v in m._modules.items()}  # a child renamed
    checked(memo, state)


def test_a_none_parameter_given_a_tensor_while_another_goes_is_seen() -> None:
    memo, lin = FlattenMemo(), torch.nn.Linear(2, 2, bias=False)
    checked(memo, {"m": lin})
    lin.weight, lin.bias = None, torch.nn.Parameter(torch.zeros(2, 2))  # as many tensors, another one
    assert [leaf.name for leaf in checked(memo, {"m": lin}).leaves] == ["m.bias"]


def test_a_state_dict_hook_or_override_is_honoured() -> None:
    memo, (m, opt) = FlattenMemo(), trained()
    state = {"model": m, "optim": opt}
    checked(memo, state)

    def rename(module, destination, prefix, local_metadata):
        destination[prefix + "renamed"] = destination.pop(prefix + "weight")

    handle = m[0]._register_state_dict_hook(rename)
    assert any(leaf.name == "model.0.renamed" for leaf in checked(memo, state).leaves)
    checked(memo, state)
    handle.remove()
    assert not any(leaf.name == "model.0.renamed" for leaf in checked(memo, state).leaves)
    only = torch.ones(1)
    m[0].state_dict = lambda *a, **k: {"only": only}             # an override on one instance
    checked(memo, {"m0": m[0]})
    checked(memo, {"m0": m[0]})


def test_optimizer_changes_are_seen() -> None:
    memo, (m, opt) = FlattenMemo(), trained()
    state = {"model": m, "optim": opt}
    checked(memo, state)
    extra = torch.nn.Parameter(torch.randn(4))
    opt.add_param_group({"params": [extra], "lr": 0.5})         # a param group added
    checked(memo, state)
    extra.grad = torch.ones(4)
    opt.step()                                                   # and its state appears
    checked(memo, state)
    fresh = torch.optim.Adam(list(m.parameters()) + [extra], lr=1e-3)
    fresh.add_param_group({"params": [], "lr": 0.1})
    loaded = opt.state_dict()
    opt.load_state_dict(loaded)                                  # new tensors for the same state
    flat = checked(memo, state)
    assert any(s.data_ptr() == opt.state[m[0].weight]["exp_avg"].data_ptr() for s in flat.sources)
    opt.state[m[0].weight]["exp_avg"] = torch.zeros(3, 4)        # one state tensor swapped
    checked(memo, state)
    opt.state[m[0].weight]["max_exp_avg_sq"] = torch.zeros(3, 4)  # a key added to a parameter's state
    checked(memo, state)
    opt.state[m[0].weight]["step"] = 3.0                         # a tensor become a plain value
    checked(memo, state)
    opt.param_groups[0]["lr"] = 0.25                             # a hyperparameter
    assert checked(memo, state).tree["v"][1]["v"][1][0]["v"][0] == 0.25


def test_dicts_of_tensors_keep_their_keys_rows_and_sharing() -> None:
    memo = FlattenMemo()
    a, b = torch.ones(2), torch.zeros(3)
    checked(memo, {"x": {"a": a, "b": b}})
    checked(memo, {"x": {"a": a, "b": torch.zeros(3)}})          # a value replaced
    checked(memo, {"x": {"a": a, "c": b}})                       # a key renamed
    checked(memo, {"x": {1: a, 2: b}})
    checked(memo, {"x": {True: a, 2: b}})                        # 1 == True, but not the same key
    checked(memo, {"x": {1.0: a, 2: b}})
    checked(memo, {"x": {"a": a, "b": a}})                       # one tensor twice: one row
    checked(memo, {"first": a, "x": {"a": a, "b": b}})           # a tensor seen before the dict
    checked(memo, {"x": {"a": a, "b": b}, "y": {"a": b}})
    checked(memo, {"y": {"a": b}, "x": {"a": a, "b": b}})        # the same dicts at other rows
    checked(memo, {"x": {"a": a, "b": b}, "n": [1, 2, True, None, "s"]})
    checked(memo, {"x": {"a": a, "b": b}, "n": [1, 2, 3.5]})


def test_a_tensor_of_a_dict_taken_over_seen_again_later_is_one_row() -> None:
    # the dict's objects are noted as a block (indexed only when asked): a later value must find them
    memo = FlattenMemo()
    a, b, c = torch.ones(2), torch.zeros(3), torch.ones(4)
    for _ in range(3):
        flat = checked(memo, {"x": {"a": a, "b": b}, "later": [c, b], "y": {"a": a}})
        assert len(flat.sources) == 3
    for _ in range(3):
        flat = checked(memo, {"x": {"a": a, "b": b}, "z": {"b": b, "c": c}})
        assert len(flat.sources) == 3
