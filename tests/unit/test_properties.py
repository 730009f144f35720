"""Property tests: any storable state comes back exactly, with its sharing intact.

States are nested dicts (str and int keys), lists and tuples of tensors and plain values.
Tensors have random dtypes and shapes (up to 3 dims, zero-size included), are sometimes
non-contiguous views (transpose, slicing with a step), sometimes the same object twice, and
sometimes two different views of one base tensor. The fast property goes through
``flatten`` -> JSON text -> ``unflatten`` + ``build_tensors`` in memory; the slow one through a
real ``Checkpointer`` save and ``mpckpt.load``. Tensors are compared by their bits, so NaN
payloads and signed zeros count.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import mpckpt
from mpckpt import _dtypes
from mpckpt._codec.snapshot import flatten
from mpckpt._codec.tree import build_tensors, unflatten

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int8, torch.uint8, torch.bool,
          torch.complex64, torch.float64]


# -- generating states ----------------------------------------------------------------------

@st.composite
def base_tensors(draw: st.DrawFn, dtypes: list[torch.dtype] = DTYPES) -> torch.Tensor:
    dtype = draw(st.sampled_from(dtypes))
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=3)))
    numel = int(torch.Size(shape).numel())
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = draw(st.binary(min_size=numel * itemsize, max_size=numel * itemsize))
    if dtype == torch.bool:
        return torch.tensor([b & 1 for b in raw], dtype=torch.bool).view(shape)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).view(shape) if raw else torch.empty(shape, dtype=dtype)


@st.composite
def views_of(draw: st.DrawFn, base: torch.Tensor) -> torch.Tensor:
    """``base`` itself, transposed, or sliced with a start and step along one dimension."""
    kind = draw(st.sampled_from(["same", "transpose", "slice"]))
    if kind == "transpose" and base.dim() >= 2:
        a, b = draw(st.permutations(range(base.dim())))[:2]
        return base.transpose(a, b)
    if kind == "slice" and base.dim() >= 1:
        d = draw(st.integers(0, base.dim() - 1))
        start = draw(st.integers(0, base.shape[d]))
        step = draw(st.integers(1, 3))
        index = [slice(None)] * base.dim()
        index[d] = slice(start, None, step)
        return base[tuple(index)]
    return base


class Pool:
    """Tensors handed out so far, so a later leaf can reuse one or view the same base."""

    def __init__(self) -> None:
        self.bases: list[torch.Tensor] = []
        self.given: list[torch.Tensor] = []


@st.composite
def tensor_leaf(draw: st.DrawFn, pool: Pool, views: bool = True, dtypes: list[torch.dtype] = DTYPES) -> torch.Tensor:
    kinds = ["new", "view", "again", "other-view", "other-view"] if views else ["new", "again"]
    choice = draw(st.sampled_from(kinds))
    if choice == "again" and pool.given:
        return draw(st.sampled_from(pool.given))  # the same object twice
    if choice == "other-view" and pool.bases:
        t = draw(views_of(draw(st.sampled_from(pool.bases))))  # another view of an earlier base
    else:
        base = draw(base_tensors(dtypes))
        pool.bases.append(base)
        t = draw(views_of(base)) if choice == "view" else base
    pool.given.append(t)
    return t


finite_floats = st.floats(allow_nan=False, allow_infinity=False)
plain = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1), finite_floats, st.text(max_size=8),
                  st.binary(max_size=8))
keys = st.one_of(st.text(max_size=6), st.integers(-5, 1000))


@st.composite
def states(draw: st.DrawFn, views: bool = True, dtypes: list[torch.dtype] = DTYPES) -> dict[Any, Any]:
    pool = Pool()
    tensor = st.deferred(lambda: tensor_leaf(pool, views, dtypes))
    leaf = st.one_of(tensor, tensor, plain)  # mostly tensors
    tree = st.recursive(
        leaf,
        lambda children: st.one_of(
            st.lists(children, max_size=4),
            st.lists(children, max_size=4).map(tuple),
            st.dictionaries(keys, children, max_size=4),
        ),
        max_leaves=12,
    )
    state = draw(st.dictionaries(keys, tree, min_size=1, max_size=5))
    # a list of more tensors, often views of (or the very objects of) those already drawn
    more = draw(st.lists(tensor, max_size=6))
    if more:
        state[draw(keys)] = draw(st.sampled_from([more, tuple(more)]))
    return state


# -- comparing -------------------------------------------------------------------------------

def bits(t: torch.Tensor) -> torch.Tensor:
    # a fresh tensor has plain strides (contiguous() keeps odd strides of size-1 dims)
    flat = torch.empty(t.shape, dtype=t.dtype).copy_(t.detach()).reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.bool else flat


def assert_exact(expected: Any, got: Any, path: str = "") -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor), path
        assert (got.dtype, got.shape) == (expected.dtype, expected.shape), (path, got.dtype, got.shape)
        assert torch.equal(bits(expected), bits(got)), path
    elif isinstance(expected, dict):
        assert type(got) is dict and list(got) == list(expected), (path, got)
        for k in expected:
            assert_exact(expected[k], got[k], f"{path}.{k!r}")
    elif isinstance(expected, (list, tuple)):
        assert type(got) is type(expected) and len(got) == len(expected), (path, got)
        for i, (a, b) in enumerate(zip(expected, got, strict=True)):
            assert_exact(a, b, f"{path}.{i}")
    else:
        assert type(got) is type(expected) and got == expected, (path, expected, got)


def tensors_in(node: Any) -> list[torch.Tensor]:
    if isinstance(node, torch.Tensor):
        return [node]
    if isinstance(node, dict):
        return [t for v in node.values() for t in tensors_in(v)]
    if isinstance(node, (list, tuple)):
        return [t for v in node for t in tensors_in(v)]
    return []


def _addresses(t: torch.Tensor) -> dict[int, tuple[int, ...]]:
    """Byte address (in its storage) of every element of ``t`` -> the element's index."""
    size = t.element_size()
    out = {}
    for index in itertools.product(*(range(n) for n in t.shape)):
        out[(t.storage_offset() + sum(i * s for i, s in zip(index, t.stride(), strict=True))) * size] = index
    return out


def assert_sharing(original: Any, loaded: Any, *, identity: bool = False) -> None:
    """Overlapping views of one base stay overlapping (a write through one shows in the other).

    The same object twice comes back as the same view of the same memory; with ``identity``
    also as the very same object.
    """
    before, after = tensors_in(original), tensors_in(loaded)
    assert len(before) == len(after)
    for (i, a), (j, b) in itertools.combinations(enumerate(before), 2):
        if a is b:
            la, lb = after[i], after[j]
            if identity:
                assert la is lb, (i, j, "the same object came back as two objects")
            elif la is not lb and a.numel():
                assert la.data_ptr() == lb.data_ptr() and la.stride() == lb.stride(), (i, j)
                assert la.untyped_storage().data_ptr() == lb.untyped_storage().data_ptr(), (i, j)
            continue
        if a.numel() == 0 or b.numel() == 0 or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
            continue
        la, lb = after[i], after[j]
        assert la.untyped_storage().data_ptr() == lb.untyped_storage().data_ptr(), (i, j, "no longer share storage")
        assert la.data_ptr() - lb.data_ptr() == a.data_ptr() - b.data_ptr(), (i, j)
        if a.dtype != b.dtype:
            continue
        addr_a, addr_b = _addresses(a), _addresses(b)
        common = sorted(set(addr_a) & set(addr_b))
        if not common:
            continue
        # write through one loaded view, read through the other
        ia, ib = addr_a[common[0]], addr_b[common[0]]
        fill = torch.ones((), dtype=a.dtype) if a.dtype == torch.bool else torch.full((), 7, dtype=a.dtype)
        old = la[ia].clone()
        la[ia] = ~old if a.dtype == torch.bool else old + fill
        assert torch.equal(bits(lb[ib]), bits(la[ia])), (i, j, "a write through one view is not seen in the other")
        la[ia] = old


# -- the properties --------------------------------------------------------------------------

def roundtrip_in_memory(state: Any) -> Any:
    flat = flatten(state)
    text = json.dumps({"tree": flat.tree, "table": flat.table}, allow_nan=False)
    doc = json.loads(text)
    leaves = []
    for leaf, source in zip(flat.leaves, flat.sources, strict=True):
        stored = source.contiguous().clone()  # what the copier writes into a slab
        leaves.append(stored if leaf.raw else _dtypes.from_stored(stored, leaf.dtype))
    return unflatten(doc["tree"], build_tensors(doc["table"], leaves))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(states())
def test_flatten_json_unflatten_is_exact(state):
    loaded = roundtrip_in_memory(state)
    assert_exact(state, loaded)
    assert_sharing(state, loaded)


def test_sharing_examples_in_memory():
    base = torch.arange(24, dtype=torch.float32).view(4, 6)
    state = {"a": base, "again": base, "t": base.t(), "rows": base[1::2], 3: (base[:, ::2], [base.t()[2:]])}
    loaded = roundtrip_in_memory(state)
    assert_exact(state, loaded)
    assert_sharing(state, loaded)
    loaded["a"][1, 0] = -1.0
    assert loaded["again"][1, 0] == -1.0
    assert loaded["rows"][0, 0] == -1.0 and loaded["t"][0, 1] == -1.0


def test_same_object_twice_is_one_object_in_memory():
    emb = torch.randn(10, 4)
    state = {"embed": emb, "lm_head": emb}
    loaded = roundtrip_in_memory(state)
    assert loaded["embed"] is loaded["lm_head"]


def test_same_empty_tensor_twice_is_one_object():
    empty = torch.empty(0)
    loaded = roundtrip_in_memory({"a": [empty], "b": empty})
    assert loaded["a"][0] is loaded["b"]


def test_same_object_twice_next_to_another_view_is_one_object():
    base = torch.arange(24, dtype=torch.float32).view(4, 6)
    loaded = roundtrip_in_memory({"a": base, "again": base, "t": base.t()})
    assert loaded["a"] is loaded["again"]


def _check_through_checkpointer(root, state_strategy: st.SearchStrategy, examples: int = 10) -> None:
    steps = itertools.count()

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate],  # no shrinking: every example is a real save
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(state_strategy)
    def check(state):
        step = next(steps)
        ckpt.save(step, state, mode="sync")
        loaded = mpckpt.load(root, step=step)
        assert_exact(state, loaded)
        assert_sharing(state, loaded)

    with mpckpt.Checkpointer(root, workers=1) as ckpt:
        check()


def test_through_a_real_checkpointer_same_object_sharing(tmp_path):
    """Real save + load of states whose only sharing is the same tensor object used twice."""
    _check_through_checkpointer(tmp_path / "run", states(views=False))


def test_through_a_real_checkpointer(tmp_path):
    """Real save + load with views of shared bases too, every dtype."""
    _check_through_checkpointer(tmp_path / "run", states(dtypes=DTYPES))


def test_views_of_one_base_after_a_half_precision_scalar_load(tmp_path):
    base = torch.arange(4, dtype=torch.float32)
    state = {"h": torch.zeros((), dtype=torch.float16), "a": base[0:2], "b": base[1:3]}
    with mpckpt.Checkpointer(tmp_path, workers=1) as ckpt:
        ckpt.save(0, state, mode="sync")
    loaded = mpckpt.load(tmp_path)
    assert_exact(state, loaded)
    assert_sharing(state, loaded)


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])
